"""``pyproject.toml`` accepts what each supported SGLang release pins, so that on a GPU node
april-async installs into SGLang's own environment (one torch, one NCCL on both sides of the
weights group), while ``tools/bootstrap.sh`` keeps the CPU machines on their pinned wheels."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from april_async.broadcaster.sglang import SGLANG_TORCH, SUPPORTED_SGLANG, TORCH_NCCL, nccl_mismatch

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PINS = {"0.5.15.post1": {"torch": "2.11.0", "transformers": "5.12.1"},
               "0.5.23": {"torch": "2.14.1", "transformers": "5.19.0"}}
"""``Requires-Dist`` of each release's wheel (``sglang-<version>-*.whl``, ``METADATA``)."""


def requirements() -> dict[str, Requirement]:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {r.name: r for r in map(Requirement, doc["project"]["dependencies"])}


def test_every_supported_sglang_releases_torch_and_transformers_are_accepted():
    reqs = requirements()
    assert SGLANG_PINS.keys() == SUPPORTED_SGLANG.keys()
    for release, pins in SGLANG_PINS.items():
        assert SUPPORTED_SGLANG[release] == pins["torch"] and pins["torch"] in TORCH_NCCL, release
        for name, version in pins.items():
            assert reqs[name].specifier.contains(version), (release, name, version, str(reqs[name]))


def test_bootstrap_pins_versions_the_project_accepts():
    reqs = requirements()
    pinned = dict(re.findall(r'"([a-z]+)==([0-9.]+)"', (ROOT / "tools" / "bootstrap.sh").read_text()))
    assert {"torch", "transformers"} <= pinned.keys(), pinned
    for name in ("torch", "transformers"):
        assert reqs[name].specifier.contains(pinned[name]), (name, pinned[name], str(reqs[name]))
    assert pinned["torch"] in TORCH_NCCL


def test_every_sglang_release_since_0_5_15_has_its_torch_and_nccl_known():
    """Read from each wheel's METADATA (``Requires-Dist: torch==``; torch's ``nvidia-nccl-cu13==``):
    the NCCL check covers the releases between the two checked ones too, which
    ``any_sglang_version`` admits."""
    assert [f"0.5.{n}" for n in range(16, 24)] == [v for v in SGLANG_TORCH if v.count(".") == 2][1:]
    assert all(SGLANG_TORCH[v] == t for v, t in SUPPORTED_SGLANG.items())
    assert all(t in TORCH_NCCL for t in SGLANG_TORCH.values())


def test_the_nccl_check_compares_major_minor_patch_and_knows_every_release():
    assert nccl_mismatch((2, 30, 7), "2.14.1", "0.5.23") is None
    assert nccl_mismatch((2, 30, 7, "a"), "2.14.1", "0.5.22") is None  # a suffixed build: a 4-tuple
    why = nccl_mismatch((2, 30, 7), "2.14.1", "0.5.19")  # 0.5.19 pins torch 2.13.0: NCCL 2.29.7
    assert why is not None and "NCCL 2.30.7 here" in why and "NCCL 2.29.7 in the server" in why
    assert "SGLang 0.5.19 pins torch 2.13.0" in why
    assert nccl_mismatch((2, 28, 9, "x"), "2.11.0", "0.5.23").startswith("NCCL 2.28.9 here")
    assert nccl_mismatch(None, "2.13.0", "0.5.23") is None  # a CPU build: no NCCL
    assert nccl_mismatch((2, 1, 1), "2.13.0", "0.6.0") is None  # a release with no known pin: unchecked
