"""The rollout role of one rank: its engine (``recipe.rollout.ENGINES``), generation, and the
device handed back to the trainer while it sleeps. The weights come in through the engine's
``load_weights`` (``recipe.rollout.sync``).

The driver sends the generation batches it starts together as one ``run`` (a list of calls, each
one batch's share of this rank) and takes each call's responses with ``result``: the calls with the
same sampling (the batches of one step: ``require_batches``) run as one engine call, and each
call's responses are ready as soon as its last one ends, while the others go on (a rank of a pool
of its own answers ``result`` beside the ``run``, ``recipe.workers.rank``). With partial rollout
(``recipe.rollout.partial``) a pause holds until ``release``: the engine call running stops after
its current token, one that starts meanwhile does not start; each call is kept here under its
key, samplers included, until ``resume`` continues it."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future

from recipe.rollout import ENGINES
from recipe.rollout import partial
from recipe.rollout.base import EngineArgs, Generation, SamplingParams
from recipe.workers.settings import RankSettings

Answer = tuple[Generation, float]  # a call's responses, and the seconds the engine spent on them


@dataclasses.dataclass
class GenerationCall:
    """One generation batch's share on this rank: its prompts, their request ids, its sampling and
    the key that names it (for ``result`` and ``resume``)."""

    prompts: list[list[int]]
    request_ids: list[int]
    params: SamplingParams
    key: int | None = None
    answer: Future = dataclasses.field(default_factory=Future, compare=False, repr=False)


class RolloutWorker:
    def __init__(self, settings: RankSettings, model_dir: str, platform: str, colocated: bool = True):
        """``colocated``: the engine shares the device with a training rank (``EngineArgs.colocated``)."""
        r = settings.rollout
        self.engine = ENGINES[r.engine].build(EngineArgs(
            model_dir=model_dir, dtype=r.dtype, platform=platform, rollout=settings.layout.rollout,
            max_model_len=r.max_model_len, seed=settings.seed, return_routed_experts=r.return_routed_experts,
            engine_kwargs=r.engine_kwargs, colocated=colocated, pausable=r.pausable,
        ))
        self.holding = False  # a pause came and the new weights have not: generations wait
        # what resume() continues, by the key of the generation call: (prompts, request ids, params,
        # the generation so far, None if it never started)
        self.paused: dict[int, tuple[list[list[int]], list[int], SamplingParams, Generation | None]] = {}
        self.calls: dict[int, GenerationCall] = {}  # run, their answers not yet taken (result)
        self._registered = threading.Condition()  # a result() may wait for its run()

    def run(self, calls: list[GenerationCall]) -> None:
        """Generate ``calls`` (``result`` gives each its answer); consecutive calls with the same
        sampling (seed included: the batches of one step) join into one engine call; batches of
        different steps run one engine call after another, each the call it would be alone (how
        many steps the bound lets go out together changes no number of the run). A call's seconds
        are the engine's since the part before it in the engine call was ready (the first: since
        the engine call began), so that a rank's seconds add up to its time generating. An error
        ends every call not answered yet with it."""
        with self._registered:
            self.calls.update({call.key: call for call in calls if call.key is not None})
            self._registered.notify_all()
        groups: list[list[GenerationCall]] = []
        for call in calls:
            if groups and groups[-1][0].params == call.params:
                groups[-1].append(call)
            else:
                groups.append([call])
        try:
            for group in groups:
                self._run_joined(group)
        except BaseException as e:
            for call in calls:
                if not call.answer.done():
                    call.answer.set_exception(e)
            return
        for call in calls:
            if not call.answer.done():  # an engine that broke its contract: say so rather than hang
                engine = type(self.engine).__name__
                call.answer.set_exception(RuntimeError(f"the {engine} gave no answer to call {call.key}"))

    def _run_joined(self, calls: list[GenerationCall]) -> None:
        # queued behind a paused generation: it starts after the push (on every rank of an engine
        # whose ranks decode together, if the pause has reached any of them)
        if any(call.key is not None for call in calls) and self.engine.agree(self.holding):
            for call in calls:
                self.paused[call.key] = call.prompts, call.request_ids, call.params, None
                call.answer.set_result((partial.held(len(call.prompts)), 0.0))
            return
        self.engine.wake_up()
        clock = [time.perf_counter()]

        def answer(i: int, out: Generation) -> None:
            now = time.perf_counter()
            call = calls[i]
            call.answer.set_result((self._kept(call.key, call.prompts, call.request_ids, call.params, out),
                                    now - clock[0]))
            clock[0] = now

        self.engine.generate([p for call in calls for p in call.prompts], calls[0].params,
                             request_ids=[i for call in calls for i in call.request_ids],
                             parts=[len(call.prompts) for call in calls], on_part=answer)

    def result(self, key: int) -> Answer:
        """Call ``key``'s answer, once it is ready (the call may not have reached ``run`` yet)."""
        with self._registered:
            self._registered.wait_for(lambda: key in self.calls)
            call = self.calls.pop(key)
        return call.answer.result()

    def generate(self, prompts: list[list[int]], request_ids: list[int], params: SamplingParams,
                 key: int | None = None) -> Answer:
        """One call run alone: its responses, and the seconds they took. ``key`` names it for ``resume``."""
        call = GenerationCall(prompts, request_ids, params, key)
        self.run([call])
        if key is not None:
            self.result(key)  # taken, as the driver would
        return call.answer.result()

    def pause(self) -> None:
        """Stop the generation running now after its current token (from another thread), and hold
        the ones that would start until ``release``."""
        self.holding = True
        self.engine.pause()

    def release(self) -> None:
        """The pushed weights are in: generations run again."""
        self.holding = False

    def resume(self, key: int) -> Answer | None:
        """Generation ``key``, every row of it, with its paused responses continued (or, held before it
        started, made from the start) under the weights the engine holds now, and the seconds that
        took; None if nothing of it waits here. A generation run in between (a validation) leaves
        the paused ones as they were. On an engine whose ranks decode together every rank takes
        part if any has something to continue (a rank may have answered its share of a joined call
        before the pause that stopped another rank's)."""
        kept = self.paused.pop(key, None)
        if not self.engine.agree(kept is not None):
            return None
        if kept is None:
            self.engine.generate([], SamplingParams())
            return None
        prompts, request_ids, params, paused = kept
        if paused is None:  # held before it started
            return self.generate(prompts, request_ids, params, key)
        start = time.perf_counter()
        out = partial.resume(self.engine, prompts, request_ids, params, paused)
        return self._kept(key, prompts, request_ids, params, out), time.perf_counter() - start

    def _kept(self, key: int | None, prompts: list[list[int]], request_ids: list[int], params: SamplingParams,
              out: Generation) -> Generation:
        """``out`` as it leaves the process; kept here for ``resume``, samplers included, if paused."""
        if key is not None and out.paused:
            self.paused[key] = prompts, request_ids, params, out
        return dataclasses.replace(out, generators=None)

    def sleep(self) -> None:
        self.engine.sleep()
