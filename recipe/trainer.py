"""The RL loop, read top to bottom: the driver holds the data, rewards and advantages and sends each
worker its share for generation, log-probs, the update and the weight sync.

One step::

    prompts ─▶ generate (n per prompt, rollout DP shares) ─▶ rewards ─▶ GRPO advantages
            ─▶ old log-probs (actor) [─▶ ref log-probs] ─▶ update (mini-batches x epochs) ─▶ weight sync
            ─▶ metrics [─▶ validation] [─▶ checkpoint]
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from loss import rollout_correction, rollout_mismatch_metrics
from megatron_bridge.runtime.batch import ROUTED_EXPERTS
from megatron_bridge.moe.table import RoutingRecord, merge_records
from megatron_bridge.runtime.batch import dp_shares, response_ends
from megatron_bridge.plan.model_spec import load_model_spec
from megatron_bridge.tiny_model import TINY
from recipe.advantage import KLController, grpo_advantages, kl_in_reward, token_advantages, varying_groups
from recipe.config import BUILTIN_TINY, RecipeConfig, config_to_dict
from recipe.data import BatchSampler, DataError, PromptDataset, PromptSample, val_batches
from recipe.loggers import Tracking, ascii_curve, on_terminal, progress_bar, read_jsonl
from recipe.metrics import Timer, data_metrics, mean_metrics, throughput_metrics
from recipe.reward import OverlongConfig, RewardInput, RewardOutput, compute_rewards, make_reward_fn
from recipe.rollout.base import SamplingParams, request_seed
from recipe.routing import replay_source, rollout_routing, routing_metrics, token_mask
from recipe.worker_group import WorkerGroup, init_ray

CHECKPOINT_PREFIX = "global_step_"
PROVENANCE_FILE = "provenance.json"
VAL_GENERATIONS_FILE = "val_generations.jsonl"
TRAINER_STATE = "trainer_state.json"


@dataclass
class Rollout:
    """One step's samples, in global row order (row = prompt index * n + sample)."""

    samples: list[PromptSample]  # per row
    groups: torch.Tensor  # [N] prompt index within the step
    response_ids: list[list[int]]
    log_probs: list[list[float]]  # the engine's, per response token
    finish_reasons: list[str]
    routed_experts: list[torch.Tensor] | None = None  # per row, when the engine reports routing


def cache_dir() -> str:
    return os.environ.get("MOE_RL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "moe_rl"))


def resolve_builtin(cfg: RecipeConfig) -> tuple[str, list[str], list[str]]:
    """The model dir and data files, with ``builtin:tiny`` replaced by the built-in task's."""
    model, train, val = cfg.actor_rollout_ref.model.path, list(cfg.data.train_files), list(cfg.data.val_files)
    if BUILTIN_TINY in (model, *train, *val):
        from recipe.tiny_task import prepare_builtin

        shape = (cfg.actor_rollout_ref.model.config or TINY) if model == BUILTIN_TINY else TINY
        task = prepare_builtin(cache_dir(), seed=0, model=shape)
        model = task.model_dir if model == BUILTIN_TINY else model
        train = [task.train_file if f == BUILTIN_TINY else f for f in train]
        val = [task.val_file if f == BUILTIN_TINY else f for f in val]
    return model, train, val


def run_dir(cfg: RecipeConfig) -> Path:
    return Path(cfg.trainer.default_local_dir)


def checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a temporary one has another name until it is renamed)."""
    found = [p for p in directory.glob(f"{CHECKPOINT_PREFIX}*")
             if p.name[len(CHECKPOINT_PREFIX):].isdigit() and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


class Trainer:
    def __init__(self, cfg: RecipeConfig):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.dir = run_dir(cfg)
        self.ckpt_dir = self.dir / "checkpoints"
        self.model_dir, train_files, val_files = resolve_builtin(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.spec = load_model_spec(self.model_dir)
        d = cfg.data
        data_kwargs = dict(prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                           filter_overlong_prompts=d.filter_overlong_prompts)
        self.train_data = PromptDataset(train_files, self.tokenizer, **data_kwargs)
        self.val_data = PromptDataset(val_files, self.tokenizer, **data_kwargs) if val_files else None
        self.sampler = BatchSampler(len(self.train_data), d.gen_batch_size or d.train_batch_size, shuffle=d.shuffle,
                                    seed=d.seed)
        t = cfg.trainer
        self.total_steps = run_length(t.total_training_steps, t.total_epochs, self.sampler.batches_per_epoch)
        self.cfg = cfg = with_warmup_from_ratio(cfg, self.total_steps)
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = KLController(k.type, k.kl_coef, k.target_kl, k.horizon)
        arr = cfg.actor_rollout_ref
        self.dynamic_batches = arr.actor.use_dynamic_bsz or arr.rollout.log_prob_use_dynamic_bsz or arr.ref.log_prob_use_dynamic_bsz
        custom = cfg.custom_reward_function
        self.reward_fn = make_reward_fn(custom.path, custom.name)
        ob = cfg.reward_model.overlong_buffer
        self.overlong = OverlongConfig(enable=ob.enable, len=ob.len, penalty_factor=ob.penalty_factor)
        self.step = 0
        self.workers: WorkerGroup | None = None

    # --- set-up ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers and restore the latest checkpoint if resuming."""
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.json").write_text(json.dumps(config_to_dict(self.cfg), indent=2, default=str))
        init_ray(self.cfg.layout.cluster.device, self.cfg.layout.cluster.world_size)
        self.workers = WorkerGroup(self.cfg.layout)
        self.infos = self.workers.setup(self.cfg, self.model_dir)
        self.dp_size = self.infos[0].dp_size
        nodes: dict[str, list[int]] = {}
        for info in self.infos:
            nodes.setdefault(info.node_ip, []).append(info.rank)
        spans = [f"node {ip} rank {r[0]}" if len(r) == 1 else f"node {ip} ranks {r[0]}-{r[-1]}" for ip, r in nodes.items()]
        tqdm.write("workers: " + "; ".join(spans))
        self.rollout_dp = self.cfg.layout.rollout.dp
        self._record_provenance()
        checkpoint = self._checkpoint_to_resume()
        if checkpoint is not None:
            state = json.loads((checkpoint / TRAINER_STATE).read_text())
            self.workers.call("load", [(str(checkpoint),)] * self.workers.world_size, "checkpoint load")
            self.step = state["step"]
            self.sampler.load_state_dict(state["sampler"])
            self.kl_ctrl.value = state.get("kl_coef", self.kl_ctrl.value)
            tqdm.write(f"resumed from {checkpoint} (step {self.step})")
        # Off a terminal the progress bar is not drawn; the console line is then the per-step line.
        loggers = self.cfg.trainer.logger
        loggers = loggers if on_terminal() or "console" in loggers else [*loggers, "console"]
        self.tracking = Tracking(str(self.dir), loggers, self.cfg.trainer.project_name,
                                 self.cfg.trainer.experiment_name, config_to_dict(self.cfg), resume=self.step > 0)
        if self.step:
            self.tracking.drop_from(self.step + 1)  # what a killed run logged past its checkpoint

    def _record_provenance(self) -> None:
        """What a comparison needs to show that runs started alike: the initial weights'
        fingerprint per rank (the checkpoint as loaded, before any resume) and the seeds. Kept
        from the run's first start."""
        path = self.dir / PROVENANCE_FILE
        if path.is_file():
            return
        fingerprints = self.workers.call("weights_fingerprint", phase="weights fingerprint")
        t = self.cfg.trainer
        path.write_text(json.dumps({"model_dir": self.model_dir, "initial_weights_fingerprint": fingerprints,
                                    "trainer_seed": t.seed, "data_seed": self.cfg.data.seed,
                                    "total_steps": self.total_steps}, indent=2))

    def _checkpoint_to_resume(self) -> Path | None:
        t = self.cfg.trainer
        if t.resume_mode == "disable":
            return None
        if t.resume_mode == "resume_path":
            path = Path(t.resume_from_path)
            if not (path / TRAINER_STATE).is_file():
                raise FileNotFoundError(f"trainer.resume_from_path={path}: not a checkpoint (no {TRAINER_STATE})")
            return path
        done = checkpoints(self.ckpt_dir)
        return done[-1] if done else None

    # --- the loop ----------------------------------------------------------------------------

    def fit(self) -> Path:
        t = self.cfg.trainer
        if self.step == 0 and t.val_before_train and self.val_data is not None:
            self.tracking.log(self.validate(), step=0)
        bar = progress_bar(total=self.total_steps, initial=self.step, desc="steps", unit="step", dynamic_ncols=True)
        while self.step < self.total_steps:
            try:
                metrics = self.train_step(self.step + 1)
            except Exception as e:
                e.add_note(f"in step {self.step + 1}; last completed step: {self.step}; run dir: {self.dir}")
                raise
            self.step += 1
            if t.test_freq > 0 and self.val_data is not None and (
                self.step % t.test_freq == 0 or self.step == self.total_steps
            ):
                metrics.update(self.validate())
            if t.save_freq > 0 and (self.step % t.save_freq == 0 or self.step == self.total_steps):
                self.save_checkpoint()
            self.tracking.log(metrics, step=self.step)
            bar.update(1)
            bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}")
        bar.close()
        return self.finish()

    def train_step(self, step: int) -> dict[str, float]:
        cfg, timer, t, a = self.cfg, Timer(), self.cfg.trainer, self.cfg.algorithm
        with timer("step"):
            with timer("gen"):
                rollout, rewards, gen_batches = self.sample(step)
            scores = torch.tensor(rewards.scores, dtype=torch.float32)
            batch = self.make_batch(rollout)
            engine_routing = rollout_routing(rollout.routed_experts, batch["input_ids"].shape[1])
            replay = cfg.actor_rollout_ref.actor.megatron.router_replay.mode
            if replay == "R3":  # the old log-probs too come from the rollout's experts
                batch[ROUTED_EXPERTS] = engine_routing
            with timer("old_log_prob"):
                batch["old_log_probs"], old = self.log_probs(batch, "actor")
            batch.pop(ROUTED_EXPERTS, None)
            if cfg.needs_reference:
                with timer("ref"):
                    batch["ref_log_probs"], _ = self.log_probs(batch, "ref")
            valid = token_mask(batch)  # before rejection sampling takes tokens out of the loss
            response_lengths = batch["response_mask"].sum(1)
            rewarded, shaping = scores, {}
            if a.use_kl_in_reward:
                rewarded, shaping = kl_in_reward(scores, batch["old_log_probs"], batch["ref_log_probs"],
                                                 batch["response_mask"], self.kl_ctrl, a.kl_penalty)
            mismatch = self.correct_for_rollout(batch, rollout)
            advantages = grpo_advantages(rewarded, rollout.groups, a.norm_adv_by_std_in_grpo, a.grpo_epsilon)
            batch["advantages"] = token_advantages(advantages, batch["response_mask"])
            if replay != "disabled":
                batch[ROUTED_EXPERTS] = old.routing if replay == "R2" else replay_source(engine_routing, old.routing)
            with timer("update_actor"):
                update, replayed = self.update(batch)
            drift = None
            if t.routing_drift_freq > 0 and step % t.routing_drift_freq == 0:
                with timer("routing_drift"):
                    drift = self.sample_routing(batch)
            with timer("reshard"):
                sync = self.workers.call("sync_weights", phase="weight sync")[0]
        metrics = data_metrics(
            scores, advantages, response_lengths, batch["prompt_lengths"],
            cfg.data.max_response_length, acc=torch.tensor(rewards.acc, dtype=torch.float32),
        )
        metrics.update(update)
        metrics.update(shaping)
        if a.use_kl_in_reward:  # verl's: the sequence rewards after the penalty, beside critic/score/*
            metrics.update({k.replace("critic/score", "critic/rewards"): v for k, v in data_metrics(
                rewarded, advantages, response_lengths, batch["prompt_lengths"], cfg.data.max_response_length).items()
                if k.startswith("critic/score/")})
        if a.filter_groups.enable:
            metrics["train/num_gen_batches"] = float(gen_batches)
        if update["actor/skipped"]:
            tqdm.write(f"step {step}: non-finite loss or grad norm ({update.get('actor/grad_norm')}): "
                       "optimizer step skipped, weights unchanged")
        metrics.update({k: v for k, v in sync.items() if k.startswith("reshard/")})
        metrics.update(mismatch)
        metrics.update(routing_metrics(old, valid, self.spec.num_experts, engine_routing, drift, replayed))
        metrics.update(timer.timings)
        tokens = int(batch["prompt_lengths"].sum() + response_lengths.sum())
        metrics.update(throughput_metrics(tokens, timer.timings["timing_s/step"], self.workers.world_size))
        # the busiest worker's peak
        for memory in self.workers.call("memory"):
            for key, value in memory.items():
                metrics[key] = max(metrics.get(key, 0.0), value)
        metrics["training/epoch"] = float(self.sampler.epoch)
        # the step's prompts, in order: runs that saw the same prompts log the same number
        prompts = rollout.samples[:: cfg.actor_rollout_ref.rollout.n]
        metrics["data/prompt_hash"] = float(zlib.crc32(torch.tensor([t for s in prompts for t in s.prompt_ids]).numpy()))
        return metrics

    def sample(self, step: int) -> tuple[Rollout, RewardOutput, int]:
        """The step's rollout and rewards, and how many generation batches it took. With
        ``algorithm.filter_groups`` (DAPO's dynamic sampling), batches of ``data.gen_batch_size``
        prompts are generated until ``data.train_batch_size`` prompts have a group whose metric
        varies; the surplus is dropped, as in verl."""
        cfg = self.cfg
        n, want, groups = cfg.actor_rollout_ref.rollout.n, cfg.data.train_batch_size, cfg.algorithm.filter_groups
        params = self.sampling_params(step)
        batches: list[tuple[Rollout, RewardOutput]] = []
        kept: list[int] = []  # prompt groups numbered across the generation batches
        while True:
            prompts = [self.train_data[i] for i in self.sampler.next_batch()]
            rollout = self.generate(prompts, n, params, first_row=len(batches) * len(prompts) * n)
            rewards = self.rewards(rollout)
            if not groups.enable:
                return rollout, rewards, 1
            metric = rewards.acc if groups.metric == "acc" else rewards.scores
            varying = varying_groups(torch.tensor(metric, dtype=torch.float64), rollout.groups)
            kept += (varying.nonzero().flatten() + len(batches) * len(prompts)).tolist()
            batches.append((rollout, rewards))
            if len(kept) >= want:
                return (*_select_groups(batches, kept[:want], n), len(batches))
            gen_batches, count = len(batches), len(kept)
            if 0 < groups.max_num_gen_batches <= gen_batches:
                raise DataError(
                    f"step {step}: after {gen_batches} generation batches only {count} of {want} prompts had responses "
                    f"whose {groups.metric} differed (algorithm.filter_groups.max_num_gen_batches="
                    f"{groups.max_num_gen_batches}): the prompts are too easy or too hard for the model; raise the "
                    "limit (<= 0: no limit) or change the data")

    # --- phases ------------------------------------------------------------------------------

    def sampling_params(self, step: int, validation: bool = False) -> SamplingParams:
        r = self.cfg.actor_rollout_ref.rollout
        # a seed per step (and per purpose): a resumed run draws what the uninterrupted one drew
        seed = request_seed(self.cfg.trainer.seed, step, stream=1 if validation else 0) & 0x7FFFFFFF
        if validation:
            v = r.val_kwargs
            temperature = v.temperature if v.do_sample else 0.0
            return SamplingParams(temperature=temperature, top_p=v.top_p, top_k=v.top_k,
                                  max_tokens=self.cfg.data.max_response_length, seed=seed)
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_tokens=self.cfg.data.max_response_length, seed=seed)

    def generate(self, prompts: list[PromptSample], n: int, params: SamplingParams, first_row: int = 0) -> Rollout:
        """``n`` responses per prompt. Rows are split into contiguous shares, one per rollout DP
        rank; every rank of a rollout TP group gets its group's share. Each row samples from its own
        seed, numbered from ``first_row`` (a step's later generation batches draw afresh)."""
        rows = [s for s in prompts for _ in range(n)]
        shares = _split(len(rows), self.rollout_dp)
        args = []
        for info in self.infos:
            lo, hi = shares[info.rollout_dp_rank]
            args.append(([s.prompt_ids for s in rows[lo:hi]], list(range(first_row + lo, first_row + hi)), params))
        outputs = self.workers.call("generate", args, "generation")
        response_ids, log_probs, finish, routed = [], [], [], []
        for info, out in zip(self.infos, outputs):
            if info.first_of_rollout_group:
                response_ids += out.token_ids
                log_probs += out.log_probs
                finish += out.finish_reasons
                routed += out.routed_experts or []
        groups = torch.arange(len(prompts)).repeat_interleave(n)
        return Rollout(rows, groups, response_ids, log_probs, finish, routed if len(routed) == len(rows) else None)

    def rewards(self, rollout: Rollout):
        inputs = [
            RewardInput(data_source=s.data_source, response_text=self.tokenizer.decode(ids, skip_special_tokens=True),
                        ground_truth=s.ground_truth, extra_info=s.extra_info, response_length=len(ids), index=i)
            for i, (s, ids) in enumerate(zip(rollout.samples, rollout.response_ids))
        ]
        return compute_rewards(inputs, self.reward_fn, self.cfg.data.max_response_length, self.overlong)

    def make_batch(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """Prompt + response per row, right-padded (the actor's batch convention)."""
        prompts = [s.prompt_ids for s in rollout.samples]
        width_r = max(1, max(len(r) for r in rollout.response_ids))
        width = max(len(p) for p in prompts) + width_r
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        response_mask = torch.zeros(len(prompts), width_r, dtype=torch.float32)
        for i, (p, r) in enumerate(zip(prompts, rollout.response_ids)):
            input_ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
            response_mask[i, : len(r)] = 1
        return {
            "input_ids": input_ids,
            "prompt_lengths": torch.tensor([len(p) for p in prompts], dtype=torch.long),
            "response_mask": response_mask,
        }

    def correct_for_rollout(self, batch: dict[str, torch.Tensor], rollout: Rollout) -> dict[str, float]:
        """With ``rollout.calculate_log_probs``: the train-rollout gap of the sampled tokens'
        log-probs (``training/``, ``rollout_corr/``) and, with ``algorithm.rollout_correction``,
        the correction: IS weights into the batch for the loss, rejected tokens out of its mask
        (so the update's global token and sequence counts leave them out too)."""
        if not self.cfg.actor_rollout_ref.rollout.calculate_log_probs:
            return {}
        mask = batch["response_mask"]
        engine = torch.zeros_like(batch["old_log_probs"])
        for row, values in enumerate(rollout.log_probs):
            engine[row, : len(values)] = torch.tensor(values, dtype=engine.dtype)
        metrics = rollout_mismatch_metrics(batch["old_log_probs"], engine, mask)
        rc = self.cfg.algorithm.rollout_correction
        if rc.rollout_is is not None or rc.rollout_rs is not None:
            weights, batch["response_mask"], corrected = rollout_correction(batch["old_log_probs"], engine, mask, rc)
            if weights is not None:
                batch["rollout_is_weights"] = weights.float()
            metrics.update(corrected)
        return metrics

    def dp_rows(self, batch: dict[str, torch.Tensor], mini_batch_rows: int) -> list[torch.Tensor]:
        """Row indices of each DP rank (``dp_shares``): by length with dynamic batch size."""
        return dp_shares(len(batch["input_ids"]), mini_batch_rows, self.dp_size,
                         response_ends(batch) if self.dynamic_batches else None)

    def mini_batch_rows(self) -> int:
        return self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size * self.cfg.actor_rollout_ref.rollout.n

    def log_probs(self, batch: dict[str, torch.Tensor], model: str) -> tuple[torch.Tensor, RoutingRecord | None]:
        """Log-probs [rows, R] under the actor or the reference; the actor's pass also gives its routing."""
        rows = len(batch["input_ids"])
        shares = self.dp_rows(batch, self.mini_batch_rows())
        args = [({k: v[shares[info.dp_rank]] for k, v in batch.items()}, model) for info in self.infos]
        outputs = self.workers.call("compute_log_probs", args, f"{model} log-probs")
        result = torch.empty(rows, batch["response_mask"].shape[1], dtype=torch.float32)
        for info, (log_probs, _) in zip(self.infos, outputs):
            if info.first_of_replica:
                result[shares[info.dp_rank]] = log_probs
        if model == "ref":
            return result, None
        return result, self.merge_routing([record for _, record in outputs], shares, batch["input_ids"].shape[1])

    def update(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, float], RoutingRecord | None]:
        """The update's metrics, and with replay what the training forwards replayed."""
        rows, mini = len(batch["input_ids"]), self.mini_batch_rows()
        shares = self.dp_rows(batch, mini)
        args = [({k: v[shares[info.dp_rank]] for k, v in batch.items()}, mini // self.dp_size) for info in self.infos]
        outputs = self.workers.call("update", args, "actor update")
        per_step = outputs[0][0]
        metrics = mean_metrics(per_step)
        # the LR and skip flag of the last optimizer step, as verl reports them
        metrics["actor/lr"] = per_step[-1]["actor/lr"]
        metrics["actor/skipped"] = float(sum(s["actor/skipped"] for s in per_step))
        replayed = None
        if ROUTED_EXPERTS in batch:
            replayed = self.merge_routing([record for _, record in outputs], shares, batch["input_ids"].shape[1])
        return metrics, replayed

    def sample_routing(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, their routing now): up to ``trainer.routing_drift_rows`` of the step's rows,
        spread over the batch, routed again by the updated actor."""
        total = len(batch["input_ids"])
        count = max(self.dp_size, min(total, self.cfg.trainer.routing_drift_rows) // self.dp_size * self.dp_size)
        rows = torch.linspace(0, total - 1, count).round().long()
        shares = list(rows.view(self.dp_size, -1))
        args = [({k: v[shares[info.dp_rank]] for k, v in batch.items() if k != ROUTED_EXPERTS},) for info in self.infos]
        records = self.workers.call("sample_routing", args, "routing drift pass")
        local = [torch.arange(len(s)) + i * len(shares[0]) for i, s in enumerate(shares)]
        return rows, self.merge_routing(records, local, batch["input_ids"].shape[1]).routing

    def merge_routing(self, records: list, shares: list[torch.Tensor], width: int) -> RoutingRecord:
        """The workers' records of one pass over the rows ``shares[dp rank]``, as one table."""
        sp = self.cfg.layout.train.sequence_parallel
        return merge_records(records, [shares[info.dp_rank] for info in self.infos],
                             [info.tp_rank == 0 or sp for info in self.infos], width, self.spec.num_layers, self.spec.moe_topk)

    def validate(self) -> dict[str, float]:
        """Greedy (or ``val_kwargs``) responses to every validation prompt: val/score, val/acc. The
        first ``trainer.log_val_generations`` go to ``val_generations.jsonl`` (prompt, response, score)."""
        v = self.cfg.actor_rollout_ref.rollout.val_kwargs
        scores, accs, lengths, shown = [], [], [], []
        for indices in val_batches(len(self.val_data), self.cfg.data.val_batch_size):
            rollout = self.generate([self.val_data[i] for i in indices], v.n, self.sampling_params(self.step, True))
            out = self.rewards(rollout)
            scores += out.scores
            accs += out.acc
            lengths += [len(r) for r in rollout.response_ids]
            for sample, response, score in zip(rollout.samples, rollout.response_ids, out.scores):
                if len(shown) < self.cfg.trainer.log_val_generations:
                    shown.append({"step": self.step, "prompt": self.tokenizer.decode(sample.prompt_ids),
                                  "response": self.tokenizer.decode(response, skip_special_tokens=True),
                                  "ground_truth": sample.ground_truth, "score": score})
        if shown:
            with open(self.dir / VAL_GENERATIONS_FILE, "a") as f:
                f.writelines(json.dumps(line, default=str) + "\n" for line in shown)
        return {"val/score/mean": sum(scores) / len(scores), "val/acc/mean": sum(accs) / len(accs),
                "val/response_length/mean": sum(lengths) / len(lengths)}

    # --- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Every worker writes its shard into a temporary directory, which is renamed into place
        once complete; older checkpoints beyond ``max_actor_ckpt_to_keep`` are removed."""
        final = self.ckpt_dir / f"{CHECKPOINT_PREFIX}{self.step}"
        tmp = self.ckpt_dir / f".{final.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.workers.call("save", [(str(tmp),)] * self.workers.world_size, "checkpoint save")
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "kl_coef": self.kl_ctrl.value}
        (tmp / TRAINER_STATE).write_text(json.dumps(state))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        keep = self.cfg.trainer.max_actor_ckpt_to_keep
        for old in checkpoints(self.ckpt_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
        return final

    def finish(self) -> Path:
        self.tracking.close()
        history = [m for m in read_jsonl(str(self.dir / "metrics.jsonl")) if "critic/score/mean" in m]
        curve = ascii_curve([m["critic/score/mean"] for m in history], label="critic/score/mean")
        (self.dir / "reward_curve.txt").write_text(curve + "\n")
        print(curve)
        print(f"metrics: {self.dir / 'metrics.jsonl'}\nreward curve: {self.dir / 'reward_curve.txt'}")
        return self.dir

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
            self.workers = None


def run_length(total_training_steps: int | None, total_epochs: int | None, steps_per_epoch: int) -> int:
    """RL steps of the run, as verl counts them: the sooner of ``total_training_steps`` and
    ``total_epochs`` passes over the data (the config asks for at least one of them)."""
    limits = [total_training_steps, None if total_epochs is None else total_epochs * steps_per_epoch]
    return max(1, min(s for s in limits if s is not None))


def with_warmup_from_ratio(cfg: RecipeConfig, total_steps: int) -> RecipeConfig:
    """verl's ``optim.lr_warmup_steps_ratio`` as ``lr_warmup_steps`` (used when that is 0): the
    fraction of ``lr_decay_steps``, or of the run's optimizer steps (mini-batches x epochs per RL step)."""
    arr = cfg.actor_rollout_ref
    actor, o = arr.actor, arr.actor.optim
    if not o.lr_warmup_steps_ratio or o.lr_warmup_steps:
        return cfg
    per_step = cfg.data.train_batch_size // actor.ppo_mini_batch_size * actor.ppo_epochs
    optim = dataclasses.replace(o, lr_warmup_steps=int(o.lr_warmup_steps_ratio * (o.lr_decay_steps or total_steps * per_step)))
    return dataclasses.replace(cfg, actor_rollout_ref=dataclasses.replace(arr, actor=dataclasses.replace(actor, optim=optim)))


def _split(rows: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal [lo, hi) ranges."""
    bounds = [round(i * rows / parts) for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def train(cfg: RecipeConfig) -> Path:
    trainer = Trainer(cfg)
    try:
        trainer.start()
        return trainer.fit()
    finally:
        trainer.close()




def _select_groups(batches: list[tuple[Rollout, RewardOutput]], groups: list[int], n: int) -> tuple[Rollout, RewardOutput]:
    """The given prompt groups (numbered across the generation ``batches``, ``n`` rows each) as one
    rollout and its rewards, groups renumbered in that order."""
    rows = [g * n + i for g in groups for i in range(n)]

    def pick(values: list[list]) -> list:
        flat = [v for part in values for v in part]
        return [flat[r] for r in rows]

    rollouts, rewards = [b[0] for b in batches], [b[1] for b in batches]
    routed = None if any(r.routed_experts is None for r in rollouts) else pick([r.routed_experts for r in rollouts])
    return (Rollout(pick([r.samples for r in rollouts]), torch.arange(len(groups)).repeat_interleave(n),
                    pick([r.response_ids for r in rollouts]), pick([r.log_probs for r in rollouts]),
                    pick([r.finish_reasons for r in rollouts]), routed),
            RewardOutput(scores=pick([r.scores for r in rewards]), acc=pick([r.acc for r in rewards]),
                         overlong_penalty=pick([r.overlong_penalty for r in rewards]),
                         extra={k: pick([r.extra[k] for r in rewards]) for k in rewards[0].extra}))
