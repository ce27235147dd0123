"""Evaluate a trained model on prompt files:

    python -m recipe.evaluate --model <HF dir | checkpoint | run dir> [--data F ...] [--n N]
                              [--temperature T] [--max-response-length L] [--out DIR] [--seed S]

The model is a Hugging Face directory, a checkpoint (``global_step_N`` or ``global_step_N/actor``,
exported to a temporary HF directory with ``recipe.model_merger.merge`` first) or a run directory:
then its base model (step 0, ``provenance.json``'s ``model_dir``) and every checkpoint, on the run's
validation files by default. One rollout engine of this device (``recipe.rollout.ENGINES``, one
process, DP1) generates; each model's weights are loaded into it. Prompts are rendered and responses
scored as the trainer does (``recipe.data.dataset.PromptDataset``, ``recipe.reward``), so on the
run's settings greedy accuracy at a checkpoint is the run's ``val/acc/mean`` at that step when its
validation was greedy.

Per ``data_source``: ``mean@N`` (mean score of the N samples per prompt), ``pass@k`` (unbiased,
correct = the reward's acc), ``maj@k`` (majority vote over the built-in reward's extracted answers)
for k = 1, 2, 4, ... <= N, and greedy accuracy and score (one extra temperature-0 pass; the
samples themselves when they are greedy). Written to ``<out>/results.json`` and ``results.md``
(also printed), and for a run ``score.png`` (score against step). Unusable inputs (model, data,
checkpoint, out dir) are one line naming the input, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_bridge.atomic import replacing, write_text
from megatron_bridge.errors import UserError
from recipe.config import BUILTIN_TINY, ActorRolloutRefConfig, DataConfig, ModelConfig, RecipeConfig, config_from_dict
from recipe.data.dataset import DataError, PromptDataset, PromptSample
from recipe.model_merger import actor_dir, merge
from recipe.reward import OverlongConfig, RewardOutput, answer_extractor, make_reward_fn, score_responses
from recipe.rollout.base import RolloutEngine, SamplingParams
from recipe.run_dir import ACTOR_DIR, CHECKPOINT_PREFIX, CHECKPOINTS_DIR, CONFIG_FILE, HF_DIR, PROVENANCE_FILE, checkpoints
from recipe.tracking.figures import Logged, Plot, cell, markdown_table, metric_figure
from recipe.tracking.loggers import progress_bar

RESULTS_FILE, TABLE_FILE, PLOT_FILE = "results.json", "results.md", "score.png"
DEFAULT_MAX_RESPONSE_LENGTH = 16  # without a run's config: the built-in task's responses
DEFAULT_BATCH_ROWS = 64  # sequences per engine call
MODEL_KINDS = "a HF model directory, a checkpoint (<run>/checkpoints/global_step_N) or a run directory"


class EvalError(UserError, ValueError):
    """An unusable argument; the message names it and the fix."""


# ---- estimators --------------------------------------------------------------------------------


def ks(n: int) -> list[int]:
    """The k reported for n samples: powers of two up to n."""
    return [1 << i for i in range(n.bit_length())]


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k of Chen et al. (2021): the chance that k of the n samples, drawn without
    replacement, include one of the ``correct`` ones."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[float], k: int) -> float:
    """Majority voting over the n // k disjoint blocks of k consecutive samples: the share of blocks
    whose most frequent answer (the first seen wins a tie; a response without an answer has no vote)
    is correct. Samples with the same answer score alike, so the answer's correctness is its first
    sample's."""
    blocks = len(answers) // k
    wins = 0.0
    for start in range(0, blocks * k, k):
        votes, right = Counter(), {}
        for answer, ok in zip(answers[start : start + k], correct[start : start + k]):
            if answer is not None:
                votes[answer] += 1
                right.setdefault(answer, ok)
        if votes:
            wins += right[votes.most_common(1)[0][0]]
    return wins / blocks


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def source_metrics(prompts: Sequence[int], n: int, sampled: RewardOutput, answers: Sequence[str | None] | None,
                   greedy: RewardOutput) -> dict[str, float]:
    """The metrics of one data source's ``prompts`` (indices): sampled rows are prompt * n + j,
    greedy rows the prompt's index; ``answers`` per sampled row (None: no extraction for it)."""
    out: dict[str, float] = {"prompts": len(prompts),
                             f"mean@{n}": _mean([sampled.scores[p * n + j] for p in prompts for j in range(n)])}
    for k in ks(n):
        out[f"pass@{k}"] = _mean([pass_at_k(n, int(sum(sampled.acc[p * n : (p + 1) * n])), k) for p in prompts])
    for k in ks(n) if answers is not None else ():
        out[f"maj@{k}"] = _mean([maj_at_k(answers[p * n : (p + 1) * n], sampled.acc[p * n : (p + 1) * n], k)
                                 for p in prompts])
    out["greedy_acc"] = _mean([greedy.acc[p] for p in prompts])
    out["greedy_score"] = _mean([greedy.scores[p] for p in prompts])
    return out


# ---- what --model is ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    label: str
    step: int | None  # a run's base model is step 0; None: a HF directory on its own
    path: Path  # a HF directory, or an actor checkpoint (exported before it is loaded)
    checkpoint: bool


def _step(checkpoint_dir: Path) -> int | None:
    """N of ``global_step_N``; None for a checkpoint directory named otherwise."""
    number = checkpoint_dir.name.removeprefix(CHECKPOINT_PREFIX)
    return int(number) if checkpoint_dir.name.startswith(CHECKPOINT_PREFIX) and number.isdigit() else None


def _checked(label: str, step: int | None, actor: Path) -> Model:
    from megatron_bridge.weights.dist_checkpoint import check_complete

    check_complete(actor)  # every checkpoint before any generation: a damaged one fails in seconds
    return Model(label, step, actor, checkpoint=True)


def find_models(path: Path) -> tuple[list[Model], Path | None]:
    """The models ``--model`` stands for, and the run directory whose settings apply (None: none)."""
    if not path.exists():
        raise EvalError(f"--model {path}: no such file or directory; give {MODEL_KINDS}")
    if (path / CONFIG_FILE).is_file() and ((path / CHECKPOINTS_DIR).is_dir() or (path / PROVENANCE_FILE).is_file()):
        provenance = path / PROVENANCE_FILE
        try:
            base = Path(json.loads(provenance.read_text())["model_dir"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise EvalError(f"--model {path}: the run's {PROVENANCE_FILE} cannot be read for the base model ({e}); "
                            "give a run directory the trainer started, or a checkpoint of it") from e
        found = [_checked(c.name, _step(c), c / ACTOR_DIR) for c in checkpoints(path / CHECKPOINTS_DIR)]
        return [Model("base", 0, base, checkpoint=False), *found], path
    if path.is_dir() and ((path / "metadata.json").is_file() or (path / ACTOR_DIR / "metadata.json").is_file()):
        actor = actor_dir(path)
        ckpt = actor.parent if actor.name == ACTOR_DIR else actor
        run = ckpt.parent.parent if ckpt.parent.name == CHECKPOINTS_DIR else None
        return [_checked(ckpt.name, _step(ckpt), actor)], run if run and (run / CONFIG_FILE).is_file() else None
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return [Model(path.name, None, path, checkpoint=False)], None
    raise EvalError(f"--model {path}: neither a HF model directory (config.json and *.safetensors), a checkpoint "
                    f"(metadata.json in it or in its {ACTOR_DIR}/) nor a run directory ({CONFIG_FILE} with checkpoints/ or {PROVENANCE_FILE}); "
                    "give one of those")


def run_config(run: Path | None, model_dir: Path) -> tuple[RecipeConfig, bool]:
    """The run's settings (True), or the recipe's defaults for ``model_dir`` (False)."""
    if run is None:
        from megatron_bridge.plan.layout import Layout

        return RecipeConfig(data=DataConfig(train_files=[]), actor_rollout_ref=(
            ActorRolloutRefConfig(model=ModelConfig(path=str(model_dir)))), layout=Layout(name="evaluate")), False
    path = run / CONFIG_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EvalError(f"{path}: the run's config cannot be read ({e}); give a run directory the trainer wrote") from e
    return config_from_dict(data, name=str(path)), True


# ---- generation --------------------------------------------------------------------------------


def hf_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A HF directory's tensors under their Hub names, one at a time (what ``load_weights`` takes)."""
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.weights.hf_checkpoint import HFCheckpoint
    from megatron_bridge.weights.load import hub_tensor_names

    spec = load_model_spec(str(model_dir))
    with HFCheckpoint(str(model_dir)) as ckpt:
        for name in hub_tensor_names(spec):
            yield name, ckpt.read(name)


def _one_rank_process_group(device: str) -> None:
    """The device engines run under an external launcher: a process group of this process alone."""
    from megatron_bridge.runtime.platform import activate, free_port, init_distributed

    port = free_port()
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)
    init_distributed(activate(device))


def build_engine(cfg: RecipeConfig, model_dir: Path, max_model_len: int,
                 seed: int) -> tuple[RolloutEngine, str, str]:
    """The run's engine if it runs on this device and is installed, else the one ``auto`` picks here
    (``auto_engine``), in the run's rollout dtype; with its name and dtype. Its weights come with
    ``load_weights``."""
    from megatron_bridge.plan.layout import RolloutParallel
    from megatron_bridge.runtime.platform import detect
    from recipe.rollout import ENGINES, auto_engine, engines_for
    from recipe.rollout.base import EngineArgs

    device = detect()
    rollout = cfg.actor_rollout_ref.rollout
    runs_here = rollout.name in engines_for(device) and not ENGINES[rollout.name].missing(device)
    name = rollout.name if runs_here else auto_engine(device)[0]
    if device != "cpu":
        _one_rank_process_group(device)
    dtype = rollout.dtype or cfg.actor_rollout_ref.model.dtype
    engine = ENGINES[name].build(EngineArgs(
        model_dir=str(model_dir), dtype=getattr(torch, dtype), platform=device, rollout=RolloutParallel(tp=1, dp=1, ep=1),
        max_model_len=max_model_len, seed=seed, return_routed_experts=False,
        engine_kwargs=rollout.engine_kwargs.get(name)))
    return engine, name, dtype


def generate(engine: RolloutEngine, samples: Sequence[PromptSample], n: int, params: SamplingParams,
             batch_rows: int, desc: str) -> list[list[int]]:
    """``n`` responses per prompt, row prompt * n + j; each row samples from its own seed (its row
    number), so the batch size changes nothing."""
    rows = [s.prompt_ids for s in samples for _ in range(n)]
    responses: list[list[int]] = []
    bar = progress_bar(total=len(rows), desc=desc, unit="seq", dynamic_ncols=True)
    for start in range(0, len(rows), batch_rows):
        chunk = rows[start : start + batch_rows]
        responses += engine.generate(chunk, params, request_ids=range(start, start + len(chunk))).token_ids
        bar.update(len(chunk))
    bar.close()
    return responses


# ---- writing -----------------------------------------------------------------------------------


def check_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise EvalError(f"--out {out}: cannot write there ({e.strerror}); give a directory this user can write") from e


def markdown(results: dict) -> str:
    s = results["settings"]
    columns = list(dict.fromkeys(k for m in results["models"] for r in m["results"].values() for k in r))
    rows = [[m["label"], cell(m["step"]), source, *(cell(r.get(c)) for c in columns)]
            for m in results["models"] for source, r in m["results"].items()]
    head = (f"Evaluation: {s['n']} sample(s) per prompt at temperature {s['temperature']:g}, at most "
            f"{s['max_response_length']} response tokens, seed {s['seed']}, engine {s['engine']} ({s['dtype']}); "
            f"greedy: temperature 0. Data: {', '.join(s['files'])}.")
    return "\n".join([head, "", *markdown_table(["model", "step", "data_source", *columns], rows)]) + "\n"


def plot(results: dict, path: Path) -> None:
    """Score against step, per data source: the samples' mean and the greedy pass's."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    n = results["settings"]["n"]
    models = [m for m in results["models"] if m["step"] is not None]
    lines = {}
    for source in dict.fromkeys(s for m in models for s in m["results"]):
        for key, name in ((f"mean@{n}", f"mean@{n}"), ("greedy_score", "greedy")):
            points = [(m["step"], m["results"][source][key]) for m in models if source in m["results"]]
            label = f"{source} {name}"
            lines[label] = [Logged({"score": points})]
    figure, _ = metric_figure(Plot(PLOT_FILE, "score", "score"), lines)
    FigureCanvasAgg(figure)
    with replacing(path) as tmp:
        figure.savefig(tmp, format="png", dpi=100)


# ---- the command -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    files: list[str]
    n: int
    temperature: float
    max_response_length: int
    seed: int
    batch_rows: int


def settings(args: argparse.Namespace, cfg: RecipeConfig, from_run: bool) -> Settings:
    """The arguments with their defaults from the run's config (``from_run``) or the built-in ones."""
    from recipe.data.tiny_task import resolve_builtin

    files = args.data or list(cfg.data.val_files)
    if not files:
        raise EvalError(f"--data is missing: {args.model} comes with no run config naming data.val_files; "
                        f"give --data <parquet> (or {BUILTIN_TINY})")
    files = resolve_builtin(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, val_files=files)))[2]
    max_response = args.max_response_length or (cfg.data.max_response_length if from_run else DEFAULT_MAX_RESPONSE_LENGTH)
    temperature = args.temperature if args.temperature is not None else (1.0 if args.n > 1 else 0.0)
    return Settings(files, args.n, temperature, max_response, args.seed, args.batch_size)


def evaluate(args: argparse.Namespace) -> dict:
    """Every model of ``--model`` on the data: ``results.json``'s content."""
    from transformers import AutoTokenizer

    models, run = find_models(args.model)
    # a checkpoint carries its base model's config and tokenizer: enough to build the engine
    config_dir = models[0].path / HF_DIR if models[0].checkpoint else models[0].path
    cfg, from_run = run_config(run, config_dir)
    reward_file = cfg.custom_reward_function.path
    if from_run and reward_file and not args.trust_reward_file:
        raise EvalError(f"{run / CONFIG_FILE} scores with {reward_file} (custom_reward_function.path), a Python file "
                        "that evaluating would import and run: pass --trust-reward-file if you trust it and the run "
                        "directory it came from")
    if run is not None and not any(m.checkpoint for m in models):
        print(f"{run}: no checkpoint yet (the run stopped before its first save): evaluating its base model "
              f"{models[0].path} (step 0) alone", file=sys.stderr)
    s = settings(args, cfg, from_run)
    check_out(args.out)
    d = cfg.data
    tokenizer = AutoTokenizer.from_pretrained(config_dir)  # the trainer's: the base model's
    data = PromptDataset(s.files, tokenizer, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                         truncation=d.truncation, filter_overlong_prompts=d.filter_overlong_prompts)
    samples = [data[i] for i in range(len(data))]
    by_source: dict[str, list[int]] = {}
    for i, sample in enumerate(samples):
        by_source.setdefault(sample.data_source, []).append(i)
    extractors = {source: answer_extractor(source) for source in by_source}
    reward_fn = make_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
    ob = cfg.reward_model.overlong_buffer
    overlong = OverlongConfig(enable=ob.enable, len=ob.len, penalty_factor=ob.penalty_factor)
    engine, engine_name, dtype = build_engine(cfg, config_dir, d.max_prompt_length + s.max_response_length, s.seed)
    sampling = SamplingParams(temperature=s.temperature, max_tokens=s.max_response_length, seed=s.seed)
    greedy_pass = SamplingParams(temperature=0.0, max_tokens=s.max_response_length)

    def score(rows: Sequence[PromptSample], responses: list[list[int]]) -> RewardOutput:
        return score_responses(rows, responses, tokenizer, reward_fn, s.max_response_length, overlong)

    evaluated = []
    for model in models:
        with tempfile.TemporaryDirectory(prefix=".export-", dir=args.out) as export:
            model_dir = Path(export) / model.label if model.checkpoint else model.path
            if model.checkpoint:
                merge(model.path, model_dir)
            engine.load_weights(hf_weights(model_dir))
        responses = generate(engine, samples, s.n, sampling, s.batch_rows, f"{model.label}: {s.n} per prompt")
        sampled = score([x for x in samples for _ in range(s.n)], responses)
        greedy = sampled if s.temperature == 0 and s.n == 1 else score(  # the samples are the greedy pass
            samples, generate(engine, samples, 1, greedy_pass, s.batch_rows, f"{model.label}: greedy"))
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses]
        results = {}
        for source, prompts in by_source.items():
            extract = extractors[source]
            answers = None if extract is None else [extract(text) for text in texts]
            results[source] = source_metrics(prompts, s.n, sampled, answers, greedy)
        evaluated.append({"label": model.label, "step": model.step, "path": str(model.path), "results": results})
    return {"settings": {**dataclasses.asdict(s), "engine": engine_name, "dtype": dtype,
                         "run": None if run is None else str(run)}, "models": evaluated}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m recipe.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path,
                        help="a HF model directory, a checkpoint (global_step_N or global_step_N/actor) or a run "
                             "directory (its base model and every checkpoint)")
    parser.add_argument("--data", nargs="+", default=None,
                        help="verl-format parquet files or a built-in task, builtin:tiny or builtin:tiny_long "
                             "(default: the run's data.val_files)")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature (default: 1.0 with --n > 1, else 0: greedy)")
    parser.add_argument("--max-response-length", type=int, default=None,
                        help=f"response tokens (default: the run's data.max_response_length, else "
                             f"{DEFAULT_MAX_RESPONSE_LENGTH})")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_ROWS,
                        help=f"sequences per engine call (default {DEFAULT_BATCH_ROWS})")
    parser.add_argument("--seed", type=int, default=1, help="sampling seed (default 1)")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default: <model>/eval)")
    parser.add_argument("--trust-reward-file", action="store_true",
                        help="import the reward file a run directory's config names (custom_reward_function.path): "
                             "its code runs here, so only for runs you trust; without it such a run is refused")
    args = parser.parse_args(argv)
    for flag, value in (("--n", args.n), ("--batch-size", args.batch_size), ("--max-response-length",
                                                                              args.max_response_length or 1)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.temperature is not None and args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.out is None:
        args.out = args.model / "eval"
    return args


def main(argv: list[str] | None = None) -> int:
    from megatron_bridge.weights.dist_checkpoint import CheckpointFilesError, CheckpointMismatchError
    from megatron_bridge.weights.hf_export import HFExportError
    from recipe.main import run_reporting

    args = parse_args(argv)
    # the export reads a checkpoint in this one process on purpose (torch.distributed.checkpoint warns)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    def body() -> None:
        results = evaluate(args)
        table = markdown(results)
        write_text(args.out / RESULTS_FILE, json.dumps(results, indent=2))
        write_text(args.out / TABLE_FILE, table)
        if results["settings"]["run"] is not None and len(results["models"]) > 1:
            plot(results, args.out / PLOT_FILE)
        print(table + f"results: {args.out / RESULTS_FILE}")

    return run_reporting(body, (EvalError, HFExportError, CheckpointFilesError, CheckpointMismatchError, DataError))


if __name__ == "__main__":
    sys.exit(main())
