"""The built-in supervised warm start: a fresh small decoder taught the task's worked answers.

RL needs a policy that is sometimes right. ``make_initial_checkpoint`` builds one from nothing, in
about a minute of one CPU core for the default ``addchain`` task:

    model      a Llama-shaped ``CausalLM`` (``ModelConfig``) sized by the config, vocabulary from
               the tokenizer, weights ~ N(0, 0.02);
    data       problems with a ``reference`` from the prompt source, each ``<bos> prompt reference
               <eos>``, packed several to a row (a block-diagonal causal mask, positions restarting
               per problem); the loss is cross-entropy on the reference and ``<eos>`` only;
    step       AdamW, linear warm-up, gradient clipping;
    stop       once the sampled reward on held-out problems (``evaluate``, every ``eval_every``
               steps) reaches ``target_reward`` — partly right, so that RL has room to climb —
               or at ``max_steps`` / ``max_seconds``;
    save       a Hugging Face checkpoint (``config.json`` + ``model.safetensors``), the tokenizer,
               and ``warmstart.json`` (the config and the training record).

With the defaults (0.40M parameters: hidden 128, 2 layers, 4 heads, 2 KV heads, intermediate 384)
the held-out reward at temperature 1 goes from 0 past the 0.3 target in 200–300 steps: 50–70 s
on one core, 1.8× faster on two (measured with seeds 0 and 1, stopping at 0.30 and 0.39). Models
of 0.8–1M parameters (3–4 layers, or wider) took about twice the CPU time to get as far, and the
RL run (6 processes on 2 cores) samples and trains the same model, so the default stays small.

The held-out reward is the math-answer one (``meta["answer"]``), which scores ``addchain`` and
JSONL/Parquet math datasets alike. Sampling uses the embedded engine (``engines/torch_engine.py``,
imported late), so that it is exactly how the run will sample.

Started by ``april up`` when ``learner.checkpoint`` is empty (section ``[warmstart]``).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from april_async.logs import get_logger
from april_async.model.decoder import CausalLM, ModelConfig
from april_async.model.tokenizer import load_tokenizer
from april_async.tasks import addchain
from april_async.tasks.base import Problem
from april_async.tasks.math_answer import score as math_score
from april_async.tasks.source import PromptSource, encode_prompt
from april_async.warmstart import WarmStartStopped
from april_async.warmstart.config import WarmStartConfig

OBSERVATION_ROOM = 256
"""Context an evaluation with tools keeps for observations, over the prompt and the policy's tokens."""
IGNORE = -100
"""Target of a position that is not trained on (prompt, padding)."""
LOG_EVERY_STEPS = 25


def model_config_for(cfg: WarmStartConfig, vocab_size: int, *, bos_id: int | None, eos_id: int | None) -> ModelConfig:
    """The decoder's shape that ``cfg`` asks for, with the tokenizer's vocabulary and special ids."""
    return ModelConfig(vocab_size=vocab_size, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                       num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                       max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
                       bos_token_id=bos_id, eos_token_id=eos_id)


# ---------------------------------------------------------------------------------------------
# Training


def write_initial_policy(init: Path | str, cfg: WarmStartConfig, stop: Callable[[], bool] | None = None) -> dict:
    """``make_initial_checkpoint`` into ``init`` as a whole: trained beside it, then renamed into place,
    so that another host (or a later run) waiting for ``init`` sees it complete or not at all.
    ``stop``: asked before every step; once it says True, ``WarmStartStopped`` (and no ``init``)."""
    init = Path(init)
    tmp = init.with_name(init.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        stats = make_initial_checkpoint(tmp, cfg, stop)
    except WarmStartStopped:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, init)
    return stats


def make_initial_checkpoint(out_dir: Path | str, cfg: WarmStartConfig | None = None,
                            stop: Callable[[], bool] | None = None) -> dict:
    """Train a fresh model on ``cfg.prompts`` and save it (with its tokenizer) into ``out_dir``;
    returns the training record (also written to ``warmstart.json``). None: the defaults.
    ``stop``: see ``write_initial_policy``."""
    cfg = cfg or WarmStartConfig()
    log = get_logger(actor="warmstart")
    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(Path(out_dir), cfg, log, stop)
    finally:
        torch.set_num_threads(threads_before)


def _train(out_dir: Path, cfg: WarmStartConfig, log, stop: Callable[[], bool] | None = None) -> dict:
    t0 = time.monotonic()
    tok = load_tokenizer(cfg.tokenizer)
    eos = tok.eos_id
    if eos is None:
        raise ValueError(f"tokenizer {cfg.tokenizer!r} has no end-of-sequence token to learn")
    torch.manual_seed(cfg.seed)
    model = CausalLM(model_config_for(cfg, tok.vocab_size, bos_id=getattr(tok, "bos_id", None), eos_id=eos))
    _init_weights(model)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
    model = model.to(dtype)
    params = sum(p.numel() for p in model.parameters())
    train_src = PromptSource(cfg.prompts.model_copy(update={"limit": None, "epochs": None}))
    held_out = held_out_problems(cfg)
    rows = _rows(train_src, tok, eos, cfg.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    log.info("start", params=params, task=cfg.prompts.kind, target_reward=cfg.target_reward, out=str(out_dir))

    losses: list[float] = []
    evals: list[dict] = []
    stopped, step, tokens = "max_steps", 0, 0
    while step < cfg.max_steps:
        if stop is not None and stop():
            log.info("stopped", step=step, seconds=round(time.monotonic() - t0, 1))
            raise WarmStartStopped(f"after {step} steps in {time.monotonic() - t0:.0f} s")
        if cfg.max_seconds is not None and time.monotonic() - t0 > cfg.max_seconds:
            stopped = "max_seconds"
            break
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
        ids, targets, positions, mask = _pack([next(rows) for _ in range(cfg.batch_rows)], cfg.seq_len)
        model.train()
        logits, _ = model(ids, positions=positions, mask=mask)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        tokens += int((targets != IGNORE).sum())
        losses.append(loss.item())
        if step % LOG_EVERY_STEPS == 0:
            log.info("step", step=step, loss=round(sum(losses[-LOG_EVERY_STEPS:]) / LOG_EVERY_STEPS, 4),
                     seconds=round(time.monotonic() - t0, 1))
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            result = evaluate_model(model, tok, held_out, temperature=cfg.eval_temperature,
                                    max_new_tokens=cfg.max_response_tokens, seed=cfg.seed, tools=tool_use(cfg))
            evals.append({"step": step, "seconds": round(time.monotonic() - t0, 1), "loss": round(losses[-1], 4),
                          **result})
            log.info("eval", **evals[-1])
            if cfg.target_reward is not None and result["reward"] is not None and result["reward"] >= cfg.target_reward:
                stopped = "target_reward"
                break

    model.eval()
    model.save_pretrained(out_dir)
    tok.save(out_dir)
    last = evals[-1] if evals else {}
    stats = {"params": params, "steps": step, "seconds": round(time.monotonic() - t0, 1), "stopped": stopped,
             "tokens": tokens, "loss_first": round(losses[0], 4) if losses else None,
             "loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4) if losses else None,
             "reward": last.get("reward"), "mean_response_len": last.get("mean_response_len"), "evals": evals}
    (out_dir / "warmstart.json").write_text(json.dumps({"config": cfg.model_dump(mode="json"), "stats": stats},
                                                       indent=2))
    log.info("done", **{k: v for k, v in stats.items() if k != "evals"})
    return stats


def held_out_problems(cfg: WarmStartConfig) -> list[Problem]:
    """The evaluation problems: ``eval_problems`` of the prompt stream ``seed + 1``; for ``addchain``
    that many distinct problems of its held-out partition (``split = "held_out"``), which no training
    stream (the warm start's, a run's) draws from: a ``ValueError`` when it holds fewer."""
    update = {"seed": cfg.prompts.seed + 1, "limit": None, "epochs": None}
    if cfg.prompts.kind != "addchain":
        src = PromptSource(cfg.prompts.model_copy(update=update))
        return [src.next() for _ in range(cfg.eval_problems)]
    size = addchain.held_out_size(cfg.prompts.chains)
    if cfg.eval_problems > size:
        raise ValueError(f"eval_problems = {cfg.eval_problems}: the addchain task's held-out partition has "
                         f"{size} problems (chains = {cfg.prompts.chains!r})")
    src = PromptSource(cfg.prompts.model_copy(update={**update, "split": "held_out"}))
    out, seen = [], set()
    while len(out) < cfg.eval_problems:  # the stream repeats problems; the evaluation set does not
        p = src.next()
        if p.prompt not in seen:
            seen.add(p.prompt)
            out.append(p)
    return out


def _init_weights(model: CausalLM) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # projections and the (tied) embedding; norms stay at one
                p.normal_(0.0, 0.02)


def _rows(src: PromptSource, tok, eos: int, seq_len: int) -> Iterator[list[tuple[list[int], int]]]:
    """Endless packed rows: lists of (``<bos> prompt reference <eos>`` ids, prompt length, the
    reference's observation spans), each list at most ``seq_len`` tokens. A problem that does not
    fit the row goes first in the next; one longer than a whole row is skipped. A reference with
    turns (``Problem.reference_turns``) is its turns' ids one after the other, each encoded alone
    as the run encodes them (the scorer encodes an observation's text by itself), and its
    observations are spans not trained on."""
    row: list[tuple[list[int], int, list[tuple[int, int]]]] = []
    used, seen_reference = 0, False
    for n in itertools.count():
        p = src.next()
        if p is None:
            raise ValueError("the warm start's prompt source ran dry")
        if p.reference is None:
            if n >= 1000 and not seen_reference:
                raise ValueError(f"prompts of kind {src.cfg.kind!r}: no reference response in the first 1000 "
                                 "problems, nothing to learn from")
            continue
        seen_reference = True
        prompt = encode_prompt(p, tok)
        seq, spans = list(prompt), []
        for k, part in enumerate(p.reference_turns or (p.reference,)):
            ids = tok.encode(part)
            if k % 2:
                spans.append((len(seq), len(ids)))
            seq += ids
        seq.append(eos)
        if len(seq) > seq_len:
            continue
        if used + len(seq) > seq_len:
            yield row
            row, used = [], 0
        row.append((seq, len(prompt), spans))
        used += len(seq)


def _pack(rows: list[list[tuple[list[int], int, list[tuple[int, int]]]]], seq_len: int):
    """Tensors of one step: ids, targets (IGNORE off the responses and on their observations),
    positions, and the block-diagonal causal mask [rows, 1, T, T] (padding attends to itself only)."""
    n = len(rows)
    ids = torch.zeros(n, seq_len, dtype=torch.long)
    targets = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    positions = torch.zeros(n, seq_len, dtype=torch.long)
    doc = torch.full((n, seq_len), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for d, (seq, prompt_len, spans) in enumerate(row):
            k = len(seq)
            ids[r, at:at + k] = torch.tensor(seq)
            targets[r, at + prompt_len - 1:at + k - 1] = torch.tensor(seq[prompt_len:])  # position t predicts t+1
            for offset, count in spans:  # a tool's answer is read, never written
                targets[r, at + offset - 1:at + offset + count - 1] = IGNORE
            positions[r, at:at + k] = torch.arange(k)
            doc[r, at:at + k] = d
            at += k
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0) & causal
    mask |= torch.eye(seq_len, dtype=torch.bool)
    return ids, targets, positions, mask[:, None]


# ---------------------------------------------------------------------------------------------
# Evaluation


def evaluate(checkpoint_dir: Path | str, problems: Iterable[Problem], n: int = 128, temperature: float = 1.0, *,
             max_new_tokens: int = 256, seed: int = 0, per_sample: bool = False,
             tools: ToolUse | None = None) -> dict:
    """Sample one response to each of the first ``n`` problems with the checkpoint (its own
    tokenizer) and score it with the math-answer reward (``meta["answer"]``), or, with ``tools``,
    run each conversation with its environment and take the environment's reward."""
    model = CausalLM.from_pretrained(Path(checkpoint_dir))
    tok = load_tokenizer(checkpoint_dir)
    return evaluate_model(model, tok, list(itertools.islice(problems, n)), temperature=temperature,
                          max_new_tokens=max_new_tokens, seed=seed, per_sample=per_sample, tools=tools)


def tool_use(cfg: WarmStartConfig) -> ToolUse | None:
    """How the warm start ``cfg`` (and the runs that start from it) evaluate: with its environment, or
    None (one turn, the math-answer reward)."""
    if cfg.environment is None:
        return None
    return ToolUse(cfg.environment, tuple(cfg.turn_stop_token_ids), cfg.max_turns)


@dataclass(frozen=True)
class ToolUse:
    """How an evaluation runs a conversation, as a run does (``[warmstart] environment``): the
    environment steps each turn in this process; a turn ends at end-of-sequence or one of
    ``turn_stop_token_ids``; at most ``max_turns`` turns; the observation is the environment's text
    as the tokenizer encodes it (what the scorer does for a tokenizer without a chat template)."""

    environment: str
    """``package.module:Name`` (``agents.env.load_environment``)."""
    turn_stop_token_ids: tuple[int, ...] = ()
    max_turns: int = 8


@torch.no_grad()
def evaluate_model(model: CausalLM, tok, problems: list[Problem], *, temperature: float, max_new_tokens: int,
                   seed: int = 0, slots: int = 64, per_sample: bool = False, tools: ToolUse | None = None,
                   engine=None) -> dict:
    """Reward (None when no problem has an answer), mean response tokens (policy and observations),
    and the share cut at ``max_new_tokens``, over one sample per problem; with ``per_sample``, also
    ``samples``: the response tokens and reward of each problem that has an answer. With ``tools``,
    also ``turns_mean`` and ``tool_share`` (conversations of more than one turn); ``max_new_tokens``
    bounds the policy's tokens over all turns, and an environment that raises scores 0. ``engine``:
    one to sample with instead of the embedded engine over ``model`` (the tests' scripted one)."""
    from april_async.agents.env import Done, Trajectory, Turn, checked, load_environment
    from april_async.engines.base import EngineRequest  # the embedded engine samples exactly as a run does
    from april_async.engines.torch_engine import TorchEngine

    env = load_environment(tools.environment) if tools is not None else None
    stops = (tok.eos_id, *(tools.turn_stop_token_ids if tools is not None else ()))
    was_training = model.training if model is not None else False
    prompts = [encode_prompt(p, tok) for p in problems]
    slots = max(1, min(slots, len(prompts)))
    room = OBSERVATION_ROOM if tools is not None else 0
    if engine is None:
        engine = TorchEngine(model, slots=slots, max_seq_len=max(map(len, prompts)) + max_new_tokens + room + 1)
    turns: dict[int, list[Turn]] = {i: [] for i in range(len(prompts))}
    current: dict[int, list[int]] = {i: [] for i in range(len(prompts))}  # the turn being sampled
    policy = [0] * len(prompts)  # policy tokens so far
    finish: dict[int, str] = {}
    rewards: dict[int, float] = {}
    waiting = list(range(len(prompts)))[::-1]
    while waiting or engine.active():
        while waiting and engine.active() < slots:
            i = waiting.pop()
            resume = [t for turn in turns[i] for t in (*turn.policy_ids, *turn.observation_ids)]
            engine.submit(EngineRequest(lease_id=i, sample_id=i, prompt=prompts[i], resume=resume,
                                        max_new_tokens=max_new_tokens - policy[i], temperature=temperature,
                                        stop_token_ids=stops, seed=(seed * 1_000_003 + i) * 101 + len(turns[i])))
        for out in engine.step():
            i = out.lease_id
            current[i].extend(out.tokens)
            policy[i] += len(out.tokens)
            if not out.finish:
                continue
            finish[i] = out.finish
            turns[i].append(Turn(policy_ids=current[i], policy_text=tok.decode(current[i])))
            current[i] = []
            if env is None:
                continue
            p = problems[i]
            used = len(prompts[i]) + sum(len(t.policy_ids) + len(t.observation_ids) for t in turns[i])
            last = len(turns[i]) >= tools.max_turns or policy[i] >= max_new_tokens
            t = Trajectory(sample_id=i, prompt_ids=prompts[i], turns=list(turns[i]), finish_reason=out.finish,
                           task=p.task, meta=dict(p.meta), prompt_text=p.prompt, last_turn=last)
            try:
                step = checked(env.step(t))
                if isinstance(step, Done) or last:
                    rewards[i] = float(step.reward) if isinstance(step, Done) else 0.0
                    continue
                text = step.observation if isinstance(step.observation, str) else step.observation["content"]
                observation = list(tok.encode(text))
            except Exception:  # a broken environment (or one the tokenizer cannot write) scores nothing here;
                rewards[i] = 0.0  # the scorer types its errors
                continue
            if used + len(observation) + 1 >= engine.max_seq_len:  # no room for a turn (the broker's context_full)
                rewards[i] = 0.0
                continue
            turns[i][-1] = Turn(policy_ids=turns[i][-1].policy_ids, observation_ids=observation,
                                policy_text=turns[i][-1].policy_text)
            waiting.append(i)
    if model is not None:
        model.train(was_training)
    responses = {i: [t for turn in turns[i] for t in (*turn.policy_ids, *turn.observation_ids)] for i in turns}
    if env is None:
        scored = [(len(responses[i]), math_score(tok.decode(responses[i]), p.meta["answer"]))
                  for i, p in enumerate(problems) if "answer" in p.meta]
    else:
        scored = [(len(responses[i]), rewards.get(i, 0.0)) for i, p in enumerate(problems) if "answer" in p.meta]
    rewards_list = [r for _, r in scored]
    lengths = [len(r) for r in responses.values()]
    out = {"reward": round(sum(rewards_list) / len(rewards_list), 4) if rewards_list else None,
           "mean_response_len": round(sum(lengths) / max(1, len(lengths)), 1),
           "truncated": round(sum(f == "length" for f in finish.values()) / max(1, len(finish)), 4),
           "n": len(problems)}
    if env is not None:
        out["turns_mean"] = round(sum(len(t) for t in turns.values()) / max(1, len(turns)), 3)
        out["tool_share"] = round(sum(len(t) > 1 for t in turns.values()) / max(1, len(turns)), 4)
    if per_sample:
        out["samples"] = [[n, float(r)] for n, r in scored]
    return out
