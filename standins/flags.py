"""The stand-in SGLang server's command line (``python -m standins.sglang_server``), apart from the
server so that a harness can read it without importing torch: the parser, and which of its flags
``/standin/configure`` may set on a running server (``RUNTIME_FLAGS``)."""

from __future__ import annotations

import argparse

DESCRIPTION = "A stand-in SGLang server for tests: SGLang's HTTP contract on top of the embedded TorchEngine."

RUNTIME_FLAGS = ("--stream-interval", "--incremental-streaming-output", "--weight-update-session",
                 "--sglang-version", "--kv-tokens", "--group-timeout-s", "--health-check-timeout",
                 "--step-delay-s", "--no-load-snapshot", "--nccl-semantics")
"""The flags ``/standin/configure`` may set on a running server: what the server reads per request
or per decode step. The others shape the process (the engine's slots and length, the checkpoint,
the address, threads)."""


class RaisingParser(argparse.ArgumentParser):
    """A parser whose errors are raised (``ValueError``), for ``/standin/configure``."""

    def error(self, message):
        raise ValueError(message)


def parser(cls=argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap = cls(prog="python -m standins.sglang_server", description=DESCRIPTION, allow_abbrev=False)
    ap.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--port", type=int, required=True, help="0: any free port")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--slots", type=int, default=16, help="max running requests; more wait (FIFO)")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--stream-interval", type=int, default=1)
    ap.add_argument("--incremental-streaming-output", action="store_true")
    ap.add_argument("--weight-update-session", action="store_true",
                    help="behave as sglang 0.5.23: begin/end sessions, /ready, a flush that ignores waiting "
                         "requests while paused and fails an update rather than the server (else 0.5.15.post1)")
    ap.add_argument("--sglang-version", default=None,
                    help="the version /server_info reports (default: 0.5.23 or 0.5.15.post1, as above)")
    ap.add_argument("--kv-tokens", type=int, default=0,
                    help="the KV pool's tokens (SGLang's max_total_num_tokens; 0: unbounded): a prompt it cannot "
                         "hold is aborted with a 400 on 0.5.23 and given no new tokens on 0.5.15")
    ap.add_argument("--group-timeout-s", type=float, default=60.0)
    ap.add_argument("--health-check-timeout", type=float, default=20.0,
                    help="SGLANG_HEALTH_CHECK_TIMEOUT: how long /health_generate waits for the scheduler")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--step-delay-s", type=float, default=0.0,
                    help="sleep after each decode step (tests that need requests to stay running)")
    ap.add_argument("--no-load-snapshot", action="store_true",
                    help="/v1/loads answers \"loads\": [], as SGLang does when its tokenizer manager's "
                         "reader of the scheduler's shared-memory load snapshot is not attached "
                         "(load_snapshot.py)")
    ap.add_argument("--nccl-semantics", action="store_true",
                    help="accept weight-update groups of backend gloo_nccl_semantics "
                         "(standins/nccl_semantics.py): gloo under NCCL's host-side behaviour, where a "
                         "broadcast's source returns whether or not anyone receives and only a watchdog at "
                         "the group's timeout ends it")
    lora = ap.add_argument_group("LoRA", "SGLang's runtime LoRA (0.5.15.post1 / 0.5.23 ``server_args``); "
                                 "no --lora-paths: adapters come through /load_lora_adapter")
    lora.add_argument("--enable-lora", action="store_true", default=None)
    lora.add_argument("--max-lora-rank", type=int, default=None)
    lora.add_argument("--lora-target-modules", nargs="*", default=None,
                      choices=[*SUPPORTED_LORA_TARGET_MODULES, "all"])
    lora.add_argument("--max-loaded-loras", type=int, default=None)
    lora.add_argument("--max-loras-per-batch", type=int, default=8)
    return ap


SUPPORTED_LORA_TARGET_MODULES = [
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "wq_b",
    "wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj", "embed_tokens",
    "lm_head"]
"""``utils/common.py`` ``SUPPORTED_LORA_TARGET_MODULES`` (0.5.15.post1; 0.5.23 adds qkvr and wo_ud)."""


def check_lora(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """SGLang's startup checks of the LoRA flags (0.5.23 ``arg_groups/lora_hook.py``
    ``check_lora_server_args``; 0.5.15 ``ServerArgs.check_lora_server_args``), each an assert there:
    here the parser's error, with SGLang's message."""
    if args.max_loras_per_batch <= 0:
        ap.error("max_loras_per_batch must be positive")
    if not args.enable_lora:
        return
    modules = args.lora_target_modules
    if modules and "all" in modules and len(modules) > 1:
        ap.error("If 'all' is specified in --lora-target-modules, it should be the only module specified.")
    if args.max_lora_rank is None or not modules:  # the stand-in takes no --lora-paths
        ap.error("When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
                 "--lora-target-modules for LoRA initialization.")
    if args.max_loaded_loras is not None and args.max_loaded_loras < args.max_loras_per_batch:
        ap.error(f"max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                 f"max_loaded_loras={args.max_loaded_loras}, max_loras_per_batch={args.max_loras_per_batch}")


RUNTIME_DESTS = tuple(f.lstrip("-").replace("-", "_") for f in RUNTIME_FLAGS)
"""``RUNTIME_FLAGS`` as the parsed arguments name them."""


def parse_args(argv: list[str], cls=RaisingParser) -> argparse.Namespace:
    """``argv`` read as the command line is (``RaisingParser``: a ``ValueError`` for a bad one)."""
    ap = parser(cls)
    args = ap.parse_args(argv)
    check_lora(args, ap)
    if args.sglang_version is None:
        args.sglang_version = "0.5.23" if args.weight_update_session else "0.5.15.post1"
    return args


def split_flags(args: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``args`` as (the flags a stand-in process must start with, those of ``RUNTIME_FLAGS``, which
    ``/standin/configure`` sets on a running one), each in its order; how many values a flag takes
    is the parser's. A word that is no flag of the parser is a ``ValueError``."""
    actions = parser()._option_string_actions  # argparse's flag -> action (it has no public one)
    start: list[str] = []
    runtime: list[str] = []
    i = 0
    while i < len(args):
        flag, inline = args[i].split("=", 1)[0], "=" in args[i]
        if flag not in actions:
            raise ValueError(f"{args[i]!r} is no flag of the stand-in SGLang server")
        n = 1 if inline or actions[flag].nargs == 0 else 2
        if not inline and actions[flag].nargs in ("*", "+"):  # every word up to the next flag
            n = 1
            while i + n < len(args) and not args[i + n].startswith("--"):
                n += 1
        (runtime if flag in RUNTIME_FLAGS else start).extend(args[i:i + n])
        i += n
    return tuple(start), tuple(runtime)
