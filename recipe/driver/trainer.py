"""The RL loop, read top to bottom: the driver holds the data, rewards and advantages and sends each
worker its share for generation, log-probs, the update and the weight sync.

One step (``Trainer.train_step``)::

    prompts ─▶ generate (n per prompt, rollout DP shares) ─▶ rewards ─▶ GRPO advantages
            ─▶ old log-probs (actor) [─▶ ref log-probs] ─▶ update (mini-batches x epochs) ─▶ weight sync
            ─▶ metrics [─▶ validation] [─▶ checkpoint]

With ``async_training.mode=one_step_off`` or ``fully_async`` the rollout has its own workers,
generates batches ahead while the trainer updates and gets the weights every T steps
(``async_schedule``); the step reads the same.

Beside it in ``recipe.driver``: ``dispatch`` (every call to the workers: shares out, results
back), ``dynamic_sampling`` (the step's samples, with DAPO's group filter), ``checkpoint``
(checkpoints, resume, provenance), ``advantage`` and ``routing`` (the step's ``moe/`` metrics),
``signals`` (SIGTERM and SIGINT: a clean stop, optionally after a checkpoint).
The batch follows ``megatron_bridge.runtime.batch``.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import zlib
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from loss import rollout_correction, rollout_mismatch_metrics
from megatron_bridge.errors import ConfigError
from megatron_bridge.plan.model_spec import load_model_spec
from megatron_bridge.runtime.batch import (
    ADVANTAGES,
    INPUT_IDS,
    OLD_LOG_PROBS,
    PROMPT_LENGTHS,
    REF_LOG_PROBS,
    RESPONSE_MASK,
    ROLLOUT_IS_WEIGHTS,
    ROUTED_EXPERTS,
    ReplayMode,
    dp_shares,
    make_batch,
    response_ends,
    right_padded,
    token_mask,
)
from recipe.config import RecipeConfig, config_to_dict
from recipe.data.dataset import BatchSampler, PromptDataset, val_batches
from recipe.data.tiny_task import resolve_builtin
from recipe import run_dir
from recipe.driver import checkpoint, dynamic_sampling
from recipe.driver.advantage import KLController, grpo_advantages, kl_in_reward, token_advantages
from recipe.driver.dispatch import Dispatch, GenerationRequest
from recipe.driver.async_schedule import AsyncSchedule
from recipe.driver.generation import GenerationStrategy, OnPolicy
from recipe.driver.rollouts import Rollout
from recipe.driver.routing import replay_source, rollout_routing, routing_metrics
from recipe.driver.signals import DriverSignals, Stopped
from recipe.reward import OverlongConfig, RewardOutput, make_reward_fn, score_responses
from recipe.rollout.base import SamplingParams, request_seed
from recipe.tracking.loggers import METRICS_FILE, Tracking, ascii_curve, on_terminal, progress_bar, read_jsonl
from recipe.tracking.metrics import Timer, data_metrics, throughput_metrics
from recipe.workers.rank import RankInfo
from recipe.workers.group import WorkerGroup, init_ray, local_ray_died, pools, shutdown_ray
from recipe.workers.settings import RankSettings

VAL_GENERATIONS_FILE = "val_generations.jsonl"


class Trainer:
    def __init__(self, cfg: RecipeConfig):
        from transformers import AutoTokenizer

        self.signals = DriverSignals(cfg.trainer.save_on_sigterm_grace_s)
        self.signals.install()
        self.cfg = cfg
        self.dir = Path(cfg.trainer.default_local_dir)
        self.ckpt_dir = self.dir / run_dir.CHECKPOINTS_DIR
        self.model_dir, train_files, val_files = resolve_builtin(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.spec = load_model_spec(self.model_dir)
        d = cfg.data
        data_kwargs = dict(prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                           filter_overlong_prompts=d.filter_overlong_prompts)
        self.train_data = PromptDataset(train_files, self.tokenizer, **data_kwargs)
        self.val_data = PromptDataset(val_files, self.tokenizer, **data_kwargs) if val_files else None
        self.sampler = BatchSampler(len(self.train_data), cfg.generation_batch_size, shuffle=d.shuffle, seed=d.seed)
        t = cfg.trainer
        steps_per_epoch = self.sampler.batches_per_epoch // cfg.async_training.generation_batches
        self.total_steps = run_length(t.total_training_steps, t.total_epochs, steps_per_epoch)
        self.cfg = cfg = with_warmup_from_ratio(cfg, self.total_steps)
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = KLController(k.type, k.kl_coef, k.target_kl, k.horizon)
        arr = cfg.actor_rollout_ref
        self.dynamic_batches = arr.actor.use_dynamic_bsz or arr.rollout.log_prob_use_dynamic_bsz or arr.ref.log_prob_use_dynamic_bsz
        self.replay = ReplayMode(arr.actor.megatron.router_replay.mode)
        custom = cfg.custom_reward_function
        self.reward_fn = make_reward_fn(custom.path, custom.name)
        ob = cfg.reward_model.overlong_buffer
        self.overlong = OverlongConfig(enable=ob.enable, len=ob.len, penalty_factor=ob.penalty_factor)
        self.step = 0
        self.started = False  # start() is done: self.step is the resumed step
        self.started_ray = False  # by start(); train() shuts it down
        self.workers: WorkerGroup | None = None
        self.rollout_workers: WorkerGroup | None = None  # a rollout pool of its own
        self.generation: GenerationStrategy | None = None  # on-policy, or the asynchronous modes' schedule
        self.pending_save: Path | None = None  # a background save's temporary directory
        self.unpublished: Path | None = None  # this step's complete checkpoint, put in place after its line
        self.holds = ExitStack()  # the run directory's lock, from start() to close()

    # --- set-up ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers and restore the latest checkpoint if resuming. What the run reads and
        writes is checked first: the checkpoint to resume from, the run directory."""
        cfg, t = self.cfg, self.cfg.trainer
        run_dir.resume_point(t, self.ckpt_dir)  # a bad resume_from_path is refused before anything is written
        try:
            self.holds.enter_context(run_dir.hold(self.dir))  # one run per directory, until close()
            # again, now that no other run can write here: its newest checkpoint counts
            resume, damaged = run_dir.resume_point(t, self.ckpt_dir)
            (self.dir / run_dir.CONFIG_FILE).write_text(json.dumps(config_to_dict(cfg), indent=2, default=str))
            for stale in run_dir.remove_stale(self.ckpt_dir):
                tqdm.write(f"removed {stale}: a checkpoint a stopped run did not finish writing")
            for path, found in damaged:
                tqdm.write(f"skipped {path}: {'; '.join(found)}; moved to {run_dir.set_aside(path)}")
        except OSError as e:
            raise ConfigError(f"trainer.default_local_dir={self.dir}: cannot write the run directory "
                              f"({e.strerror}: {e.filename}); give a directory this user can write") from e
        training, rollout = pools(cfg.layout)
        ranks = training.size + (rollout.size if rollout else 0)
        device = cfg.layout.cluster.device
        self.started_ray = init_ray(device, ranks)
        self.signals.install()  # ray.init replaced the handlers
        # on the CPU every pool's ranks share the one machine's cores
        per_node = training.devices_per_node + (rollout.devices_per_node if rollout else 0)
        self.workers = WorkerGroup(training, device, per_node)
        settings = RankSettings.of(cfg)
        if rollout is not None:
            self.rollout_workers = WorkerGroup(rollout, device, per_node, taken=self.workers.node_ips)
            starting = self.rollout_workers.start_setup(settings, self.model_dir)
        infos = self.workers.setup(settings, self.model_dir)
        self.dispatch = Dispatch(self.workers, infos, cfg.layout, self.spec, self.rollout_workers,
                                 cfg.async_training.weight_sync_timeout_s)
        self.dp_size = self.dispatch.dp_size
        self.generation = OnPolicy(self.dispatch, self.generation_request)
        tqdm.write("workers: " + _placement(infos))
        checkpoint.record_provenance(self.dir, self.workers, self.model_dir, t.seed, cfg.data.seed, self.total_steps)
        if resume is not None:
            state, rng = checkpoint.load(self.workers, resume)
            self.step = state["step"]
            self.sampler.load_state_dict(state["sampler"])
            self.kl_ctrl.value = state.get("kl_coef", self.kl_ctrl.value)
            tqdm.write(f"resumed from {resume} (step {self.step})" + ("" if rng else
                       "; written under another layout: weights, optimizer and schedule resharded, RNG states as seeded"))
        if self.rollout_workers is not None:  # the engines get the actor's weights, resumed or initial
            self.rollout_workers.infos = self.rollout_workers.get(starting, "start-up")
            tqdm.write("rollout workers: " + _placement(self.rollout_workers.infos))
            self.dispatch.connect_rollout()
            a = cfg.async_training
            self.generation = AsyncSchedule(self.dispatch, self.generation_request, self.total_steps, a.sync_every,
                                            a.batches_ahead, self.step, a.wait_rollout_timeout_s, a.partial_rollout,
                                            a.generation_batches)
        # Off a terminal the progress bar is not drawn; the console line is then the per-step line.
        loggers = t.logger if on_terminal() or "console" in t.logger else [*t.logger, "console"]
        self.tracking = Tracking(str(self.dir), loggers, t.project_name, t.experiment_name, config_to_dict(cfg),
                                 resume=self.step > 0)
        if self.step:
            self.tracking.drop_from(self.step + 1)  # what a killed run logged past its checkpoint
        self.started = True

    # --- the loop ----------------------------------------------------------------------------

    def fit(self) -> Path:
        t = self.cfg.trainer
        if self.step == 0 and t.val_before_train and self.val_data is not None:
            self.tracking.log(self.validate(), step=0)
        bar = progress_bar(total=self.total_steps, initial=self.step, desc="steps", unit="step", dynamic_ncols=True)
        with self.signals.steps():
            while self.step < self.total_steps:
                try:
                    metrics = self.train_step(self.step + 1)
                except Exception as e:
                    e.add_note(f"in step {self.step + 1}; {self.progress()}")
                    raise
                self.step += 1
                if self.validates_after(self.step):
                    metrics.update(self.validate())
                saved = t.save_freq > 0 and (self.step % t.save_freq == 0 or self.step == self.total_steps)
                if saved:
                    metrics.update(self.save_checkpoint(wait=self.step == self.total_steps, publish=False))
                with self.signals.held():  # a stop between the two would resume before a logged step
                    self.tracking.log(metrics, step=self.step)
                    self.publish_checkpoint()
                bar.update(1)
                bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}")
                # a SIGTERM waiting for this step's end stops after a complete checkpoint: this step's own
                # (finished, if it is being written in the background) or one saved now
                self.signals.step_ended(self._finish_save if saved else partial(self.save_checkpoint, wait=True))
        bar.close()
        return self.finish()

    def train_step(self, step: int) -> dict[str, float]:
        cfg, timer, t, a, replay = self.cfg, Timer(), self.cfg.trainer, self.cfg.algorithm, self.replay
        mini = self.mini_batch_rows()
        with timer("step"):
            with timer("gen"):
                rollout, rewards, gen_batches = self.sample(step)
            scores = torch.tensor(rewards.scores, dtype=torch.float32)
            batch = make_batch([s.prompt_ids for s in rollout.samples], rollout.response_ids,
                               self.tokenizer.pad_token_id or 0)
            engine_routing = rollout_routing(rollout.routed_experts, batch[INPUT_IDS].shape[1])
            shares = self.dp_rows(batch, mini)
            if replay.in_old_log_prob_pass:  # R3: the old log-probs too come from the rollout's experts
                batch[ROUTED_EXPERTS] = engine_routing
            with timer("old_log_prob"):
                batch[OLD_LOG_PROBS], old = self.dispatch.log_probs(batch, shares, "actor", replay.in_old_log_prob_pass)
            batch.pop(ROUTED_EXPERTS, None)
            if cfg.needs_reference:
                with timer("ref"):
                    batch[REF_LOG_PROBS], _ = self.dispatch.log_probs(batch, shares, "ref")
            valid = token_mask(batch)  # before rejection sampling takes tokens out of the loss
            response_lengths = batch[RESPONSE_MASK].sum(1)
            rewarded, shaping = scores, {}
            if a.use_kl_in_reward:
                rewarded, shaping = kl_in_reward(scores, batch[OLD_LOG_PROBS], batch[REF_LOG_PROBS],
                                                 batch[RESPONSE_MASK], self.kl_ctrl, a.kl_penalty)
            mismatch = self.correct_for_rollout(batch, rollout)
            advantages = grpo_advantages(rewarded, rollout.groups, a.norm_adv_by_std_in_grpo, a.grpo_epsilon)
            batch[ADVANTAGES] = token_advantages(advantages, batch[RESPONSE_MASK])
            if replay.in_update:
                batch[ROUTED_EXPERTS] = old.routing if replay is ReplayMode.R2 else replay_source(engine_routing, old.routing)
            with timer("update_actor"):  # shares again: rejection sampling may have shortened rows
                update, replayed = self.dispatch.update(batch, self.dp_rows(batch, mini), mini, replay.in_update)
            drift = None
            if t.routing_drift_freq > 0 and step % t.routing_drift_freq == 0:
                with timer("routing_drift"):
                    drift = self.dispatch.sample_routing(batch, t.routing_drift_rows)
            sync = self.push_weights(step, timer)
        metrics = data_metrics(
            scores, advantages, response_lengths, batch[PROMPT_LENGTHS],
            cfg.data.max_response_length, acc=torch.tensor(rewards.acc, dtype=torch.float32),
        )
        metrics.update(update)
        metrics.update(shaping)
        if a.use_kl_in_reward:  # verl's: the sequence rewards after the penalty, beside critic/score/*
            metrics.update({k.replace("critic/score", "critic/rewards"): v for k, v in data_metrics(
                rewarded, advantages, response_lengths, batch[PROMPT_LENGTHS], cfg.data.max_response_length).items()
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
        step_seconds = timer.timings["timing_s/step"]
        metrics.update(self.generation.metrics(step, rollout, step_seconds))
        tokens = int(batch[PROMPT_LENGTHS].sum() + response_lengths.sum())
        devices = self.workers.world_size + (self.rollout_workers.world_size if self.rollout_workers else 0)
        metrics.update(throughput_metrics(tokens, step_seconds, devices))
        metrics.update(self.dispatch.memory())
        metrics["training/epoch"] = float(self.sampler.epoch)
        # the step's prompts, in order: runs that saw the same prompts log the same number
        prompts = rollout.samples[:: cfg.actor_rollout_ref.rollout.n]
        metrics["data/prompt_hash"] = prompt_hash(prompts)
        return metrics

    # --- phases ------------------------------------------------------------------------------

    def sample(self, step: int) -> tuple[Rollout, RewardOutput, int]:
        """The step's rollout and rewards, and how many generation batches it took (``dynamic_sampling``)."""
        cfg = self.cfg

        def generate(index: int) -> tuple[Rollout, RewardOutput]:
            rollout = self.generation.batch(step, index)
            return rollout, self.rewards(rollout)

        return dynamic_sampling.sample(generate, cfg.actor_rollout_ref.rollout.n, cfg.data.train_batch_size,
                                       cfg.algorithm.filter_groups, step)

    def push_weights(self, step: int, timer: Timer) -> dict[str, float]:
        """The update's weights to the engines (``timing_s/reshard``): colocated ones after every step;
        a rollout pool of its own when the schedule's push is due and before a validation (which
        then sees the current policy), else the rollout goes on generating."""

        def sync() -> dict[str, float]:
            with timer("reshard"):
                return self.dispatch.sync_weights()

        return self.generation.after_update(step, sync, self.validates_after(step))

    def validates_after(self, step: int) -> bool:
        """A validation follows step ``step``: every ``trainer.test_freq`` steps and after the last."""
        t = self.cfg.trainer
        return t.test_freq > 0 and self.val_data is not None and (step % t.test_freq == 0 or step == self.total_steps)

    def generation_request(self, step: int, index: int = 0) -> GenerationRequest:
        """The sampler's next prompts as ``step``'s ``index``-th generation batch (its seeds)."""
        n = self.cfg.actor_rollout_ref.rollout.n
        prompts = [self.train_data[i] for i in self.sampler.next_batch()]
        return GenerationRequest(prompts, n, self.sampling_params(step), first_row=index * len(prompts) * n)

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

    def rewards(self, rollout: Rollout) -> RewardOutput:
        return score_responses(rollout.samples, rollout.response_ids, self.tokenizer, self.reward_fn,
                               self.cfg.data.max_response_length, self.overlong)

    def correct_for_rollout(self, batch: dict[str, torch.Tensor], rollout: Rollout) -> dict[str, float]:
        """With ``rollout.calculate_log_probs``: the train-rollout gap of the sampled tokens'
        log-probs (``training/``, ``rollout_corr/``) and, with ``algorithm.rollout_correction``,
        the correction: IS weights into the batch for the loss, rejected tokens out of its mask
        (so the update's global token and sequence counts leave them out too)."""
        if not self.cfg.actor_rollout_ref.rollout.calculate_log_probs:
            return {}
        mask = batch[RESPONSE_MASK]
        engine = right_padded(rollout.log_probs, mask.shape[1])
        metrics = rollout_mismatch_metrics(batch[OLD_LOG_PROBS], engine, mask)
        rc = self.cfg.algorithm.rollout_correction
        if rc.rollout_is is not None or rc.rollout_rs is not None:
            weights, batch[RESPONSE_MASK], corrected = rollout_correction(batch[OLD_LOG_PROBS], engine, mask, rc)
            if weights is not None:
                batch[ROLLOUT_IS_WEIGHTS] = weights.float()
            metrics.update(corrected)
        return metrics

    def dp_rows(self, batch: dict[str, torch.Tensor], mini_batch_rows: int) -> list[torch.Tensor]:
        """Row indices of each DP rank (``dp_shares``): by length with dynamic batch size."""
        return dp_shares(len(batch[INPUT_IDS]), mini_batch_rows, self.dp_size,
                         response_ends(batch) if self.dynamic_batches else None)

    def mini_batch_rows(self) -> int:
        return self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size * self.cfg.actor_rollout_ref.rollout.n

    def validate(self) -> dict[str, float]:
        """Greedy (or ``val_kwargs``) responses to every validation prompt: val/score, val/acc. The
        first ``trainer.log_val_generations`` go to ``val_generations.jsonl`` (prompt, response, score)."""
        v = self.cfg.actor_rollout_ref.rollout.val_kwargs
        scores, accs, lengths, shown = [], [], [], []
        for indices in val_batches(len(self.val_data), self.cfg.data.val_batch_size):
            rollout = self.dispatch.generate([self.val_data[i] for i in indices], v.n,
                                             self.sampling_params(self.step, True))
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

    # --- the end -----------------------------------------------------------------------------

    def save_checkpoint(self, wait: bool = True, publish: bool = True) -> dict[str, float]:
        """Every worker's shard and the driver's state (``recipe.driver.checkpoint``, ``recipe.run_dir``). With
        ``actor.checkpoint.async_save`` and not ``wait``, the workers write in the background and
        the checkpoint is put in place at the next save (or the run's end). Without ``publish``, a
        checkpoint completed now waits for ``publish_checkpoint``. Returns
        ``timing_s/save_checkpoint`` (what the loop waited: this save's staging, and the wait for
        the one before) and ``perf/checkpoint_bytes`` of the checkpoint completed now, if one was."""
        timer, done = Timer(), None
        with timer("save_checkpoint"):
            done = self._finish_save()
            # The position before the next step's batch: batches made ahead (asynchronous modes) are
            # drawn again by a resumed run, not skipped.
            sampler = self.sampler.state_at(self.sampler.drawn - self.generation.drawn_ahead(self.step))
            state = {"step": self.step, "sampler": sampler, "kl_coef": self.kl_ctrl.value}
            self.pending_save = checkpoint.start_save(self.workers, self.ckpt_dir, self.step, state, self.model_dir)
            if wait or not self.cfg.actor_rollout_ref.actor.checkpoint.async_save:
                done = self._finish_save(publish)
        return {**timer.timings, **({"perf/checkpoint_bytes": run_dir.disk_bytes(done)} if done else {})}

    def _finish_save(self, publish: bool = True) -> Path | None:
        if self.pending_save is None:
            return None
        hf_model = "hf_model" in self.cfg.actor_rollout_ref.actor.checkpoint.save_contents
        done = checkpoint.finish_save(self.workers, self.pending_save, self.model_dir if hf_model else None)
        self.pending_save, self.unpublished = None, done
        return self.publish_checkpoint() if publish else done

    def publish_checkpoint(self) -> Path | None:
        """Put the checkpoint completed at this step in place. The loop does it after the step's
        metrics line is written: a run killed between the two resumes from the step before and logs
        this step again, where the other order would resume after a step whose line is lost."""
        if self.unpublished is None:
            return None
        done = run_dir.publish(self.unpublished, self.cfg.trainer.max_actor_ckpt_to_keep)
        self.unpublished = None
        return done

    def finish(self) -> Path:
        self.tracking.close()
        history = [m for m in read_jsonl(str(self.dir / METRICS_FILE)) if "critic/score/mean" in m]
        curve = ascii_curve([m["critic/score/mean"] for m in history], label="critic/score/mean")
        (self.dir / run_dir.REWARD_CURVE_FILE).write_text(curve + "\n")
        print(curve)
        print(f"metrics: {self.dir / METRICS_FILE}\nreward curve: {self.dir / run_dir.REWARD_CURVE_FILE}")
        return self.dir

    def progress(self) -> str:
        """Where the run is, for a message that ends it: the last step completed and the checkpoint
        a re-run resumes from (which may be older)."""
        done = f"last completed step: {self.step}" if self.started else "during start-up"
        return f"{done}; {run_dir.rerun_note(self.cfg.trainer, self.ckpt_dir)}"

    def close(self) -> None:
        for group in (self.workers, self.rollout_workers):
            if group is not None:
                group.close()
        self.workers = self.rollout_workers = None
        self.holds.close()


def prompt_hash(prompts: list) -> float:
    """A checksum of the prompts' token ids, in order: runs that saw the same prompts log the same."""
    return float(zlib.crc32(torch.tensor([t for p in prompts for t in p.prompt_ids]).numpy()))


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


def train(cfg: RecipeConfig) -> Path:
    """Train; a signal ends it as ``Stopped`` saying where a re-run resumes (``recipe.driver.signals``)."""
    trainer = Trainer(cfg)
    ray_gone = False
    try:
        trainer.start()
        return trainer.fit()
    except KeyboardInterrupt:  # Ray's waits raise a plain one for the handler's Stopped
        stopped = trainer.signals.stopped or Stopped(signal.SIGINT)
        stopped.where = trainer.progress()
        # A signal to the whole process group (a scheduler's cancel, `timeout`) ended the local Ray
        # with the driver: nothing to end, and Ray's client would hold the exit for 60 s.
        ray_gone = stopped.exit_now = trainer.started_ray and local_ray_died(within_s=1.0)
        raise stopped from None
    finally:
        if ray_gone:
            trainer.holds.close()  # the run directory's lock; the workers and Ray are gone already
        else:
            trainer.close()
            if trainer.started_ray:
                shutdown_ray()


def _placement(infos: list[RankInfo]) -> str:
    """Which ranks run on which node: "node 10.0.0.1 ranks 0-15; node 10.0.0.2 ranks 16-31"."""
    nodes: dict[str, list[int]] = {}
    for info in infos:
        nodes.setdefault(info.node_ip, []).append(info.rank)
    return "; ".join(f"node {ip} rank {r[0]}" if len(r) == 1 else f"node {ip} ranks {r[0]}-{r[-1]}" for ip, r in nodes.items())
