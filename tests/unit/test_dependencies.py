"""``pyproject.toml`` accepts what each supported SGLang release pins, so that on a GPU node
april-async installs into SGLang's own environment (one torch, one NCCL on both sides of the
weights group), while ``tools/bootstrap.sh`` keeps the CPU machines on their pinned wheels."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from april_async.broadcaster.sglang import SUPPORTED_SGLANG, TORCH_NCCL

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
