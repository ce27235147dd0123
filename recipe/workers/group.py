"""Ray plumbing: one Ray actor per device, placed node by node with placement groups, and calls to
all of them that turn a dead worker into a message naming it and its node, and a worker's refusal of its
input or a failed weight sync (``NAMED_ERRORS``) into that error, without Ray's wrapping.

A pool (``Pool``) is the ranks of one kind, one ``recipe.workers.rank.Rank`` per device with the
pool's roles: colocated, the training devices with both roles; with a rollout pool of its own, the
training ranks with the actor role and, in a second group, the rollout ranks (``pools``). A call
names the method it runs (``call(Rank.update, ...)``), so a reader can follow it."""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megatron_bridge.errors import ConfigError, UserError
from megatron_bridge.plan.layout import Layout
from recipe.rollout.broadcast import WeightSyncError
from recipe.workers.rank import CONCURRENT, Rank, RankInfo, Roles
from recipe.workers.settings import RankSettings

# Ray's resource name for one device of each platform (Ray schedules Ascend NPUs as "NPU").
DEVICE_RESOURCE = {"npu": "NPU", "cuda": "GPU", "cpu": None}
PLACEMENT_TIMEOUT_S = 120
# How long a local Ray's raylet gets to register with its GCS. Ray 2.60 gives it a fixed 30 s, which a
# machine busy with other runs' processes can take (seen in CI); a start that takes longer is started
# once more.
RAYLET_REGISTRATION_S = 120
# When one worker's call fails, how long the others get to end theirs before the error names the
# failed ones (the others may be blocked in a collective with the failed one, and never end).
PEERS_TIMEOUT_S = 30
# When a collective fails on one side, how long Ray gets to report a worker of the other side dead
# (the cause, then named) before the failed side's own error is raised
DEATH_NOTICE_S = 5
HEAD_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node
# What a worker raises about its input (a file, a key): the driver re-raises it as it is, naming the
# worker, as it does a weight sync that failed on a worker (its message names what failed and the
# timeout); anything else keeps Ray's report with the worker's traceback.
INPUT_ERRORS = (ConfigError, OSError)
NAMED_ERRORS = (*INPUT_ERRORS, WeightSyncError)


def device_options(device: str) -> dict[str, Any]:
    """The Ray actor options that give one rank one device (Ray then sets the rank's
    CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES). Ray takes GPUs as ``num_gpus`` only: it
    refuses "GPU" in ``resources``."""
    resource = DEVICE_RESOURCE[device]
    if resource is None:
        return {}
    return {"num_gpus": 1} if resource == "GPU" else {"resources": {resource: 1}}


class ClusterError(UserError, RuntimeError):
    """The Ray cluster lacks the nodes or devices the layout needs."""


class WorkerDiedError(UserError, RuntimeError):
    """A worker process ended (crash, OOM kill, node loss); the run cannot go on without it."""


class WorkerTimeoutError(UserError, RuntimeError):
    """Workers did not answer a call within its time limit (hung, or slower than the limit)."""


@dataclass(frozen=True)
class Pool:
    """Ranks of one kind: their roles, nodes and devices, what a message calls one of its ranks and
    which keys size it."""

    roles: Roles
    nnodes: int
    devices_per_node: int
    label: str = "worker"
    keys: str = "trainer.nnodes / trainer.n_gpus_per_node"

    @property
    def size(self) -> int:
        return self.nnodes * self.devices_per_node


def pools(layout: Layout) -> tuple[Pool, Pool | None]:
    """The training pool, and the rollout's own pool when it has one (``hybrid_engine=false``)."""
    c, r = layout.cluster, layout.rollout
    if not layout.separate_rollout:
        return Pool(Roles.BOTH, c.nnodes, c.devices_per_node), None
    return (Pool(Roles.TRAIN, c.nnodes, c.devices_per_node),
            Pool(Roles.ROLLOUT, r.nnodes or 1, r.devices_per_node, "rollout worker",
                 "actor_rollout_ref.rollout.nnodes / n_gpus_per_node"))


def init_ray(device: str, world_size: int) -> bool:
    """Join the cluster when run under ``ray job submit`` (RAY_ADDRESS is set), else start a local
    Ray with enough CPUs for one worker per simulated device. False: Ray was up already."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level="WARNING")
        return True
    cpus = max(os.cpu_count() or 1, world_size) if device == "cpu" else None
    private_auth_token()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        _start_local_ray(cpus)
    except Exception as e:  # Ray raises a bare Exception for this one
        if "timed out during startup" not in str(e):
            raise
        # The failed start's processes are ours alone and nothing ends them: end them first.
        for process in psutil.Process().children(recursive=True):
            if process.pid not in before:
                process.kill()
        print(f"local Ray did not come up within {RAYLET_REGISTRATION_S} s (a busy machine?): starting it once more",
              file=sys.stderr, flush=True)
        _start_local_ray(cpus)
    return True


def private_auth_token() -> None:
    """Ray 2.60 turns its token auth on for a local Ray (``RAY_AUTH_MODE`` unset) and, with no token
    yet, writes one to ``~/.ray/auth_token`` readable by every user: the password of every cluster
    that uses the file. Write it first, readable by its owner only, or make an existing one so."""
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token" or os.environ.get("RAY_AUTH_TOKEN"):
        return
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, written = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # readable by its owner only
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))  # what Ray's own generator makes
        try:  # whole or not at all, and never over a token another run put there meanwhile
            os.link(written, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(written)
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)
        print(f"made {path} readable by its owner only (it is the password of the Ray clusters that use it)",
              file=sys.stderr, flush=True)


def _start_local_ray(cpus: int | None) -> None:
    # address="local": a new Ray of our own, never a cluster `ray start` once recorded on this machine.
    with patient_node_lookup(RAYLET_REGISTRATION_S):
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level="WARNING")


@contextlib.contextmanager
def patient_node_lookup(seconds: float) -> Iterator[None]:
    """Ray's start-up asks the GCS for the new node in a loop that gives up after a fixed 30 s; within
    this, each ask waits up to ``seconds`` for the node to be registered (``ray._private.services
    .get_node`` raises RuntimeError until it is)."""
    services = ray._private.services
    get_node = services.get_node

    def patient(*args, **kwargs):
        deadline = time.monotonic() + seconds
        while True:
            try:
                return get_node(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    services.get_node = patient
    try:
        yield
    finally:
        services.get_node = get_node


def local_ray_died(within_s: float) -> bool:
    """The local Ray this process started loses a process of its own (its GCS, its raylet) within
    ``within_s``: as when a signal to the whole process group reaches them with the driver. Its
    client would then wait 60 s for the GCS and end the process with exit 1."""
    node = ray._private.worker._global_node
    if node is None or not node.head:
        return False
    deadline = time.monotonic() + within_s
    while node.remaining_processes_alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def shutdown_ray() -> None:
    """End what ``init_ray`` began: the local Ray's processes; joined to a cluster, only this
    driver's connection (Ray stops only the processes this process started)."""
    ray.shutdown()


def pick_nodes(nodes: list[dict], nnodes: int, devices_per_node: int, resource: str | None,
               keys: str = Pool.keys, taken: Sequence[str] = ()) -> list[dict]:
    """The ``nnodes`` nodes the run takes (``ray.nodes()`` entries): alive ones that offer a whole
    node's devices, the head first. ``taken``: addresses of the nodes another pool holds; a pool of
    devices never shares a node with it (the rollout pool's nodes are its own), while CPU ranks,
    processes on a node's cores, do. Raises naming what the cluster has when too few qualify."""
    taken = set(taken) if resource else set()
    fit = [n for n in nodes if n["Alive"] and n["NodeManagerAddress"] not in taken
           and (resource is None or n["Resources"].get(resource, 0) >= devices_per_node)]
    fit.sort(key=lambda n: (HEAD_RESOURCE not in n["Resources"], n["NodeManagerAddress"]))
    if len(fit) < nnodes:
        have = ", ".join(f"{n['NodeManagerAddress']} ({int(n['Resources'].get(resource, 0))} {resource})" if resource
                         else n["NodeManagerAddress"] for n in nodes if n["Alive"]) or "none"
        besides = f" besides the {len(taken)} node(s) of the other pool ({', '.join(sorted(taken))})" if taken else ""
        raise ClusterError(
            f"the run needs {nnodes} node(s) with {devices_per_node} {resource or 'CPU ranks'} each{besides}; the Ray "
            f"cluster has {len(fit)} such node(s) (alive: {have}). Check {keys} against the nodes that joined"
        )
    return fit[:nnodes]


def devices_per_node_offered(layout: Layout) -> int:
    """What each node offers Ray, every node running the same launcher: on devices the larger of
    the two pools' per-node counts (a node belongs to one pool), on the CPU the ranks of both."""
    training, rollout = pools(layout)
    if rollout is None:
        return training.devices_per_node
    if DEVICE_RESOURCE[layout.cluster.device] is None:
        return training.devices_per_node + rollout.devices_per_node
    return max(training.devices_per_node, rollout.devices_per_node)


def nodes_needed(layout: Layout) -> int:
    """How many nodes the run takes: the rollout's own pool on devices adds its nodes to the
    training pool's; on the CPU both pools' ranks share the nodes (``pick_nodes``)."""
    training, rollout = pools(layout)
    if rollout is None:
        return training.nnodes
    if DEVICE_RESOURCE[layout.cluster.device] is None:
        return max(training.nnodes, rollout.nnodes)
    return training.nnodes + rollout.nnodes


class WorkerGroup:
    def __init__(self, pool: Pool, device: str, cpu_ranks_per_node: int, taken: Sequence[str] = ()):
        """``pool``'s ranks as Ray actors, on nodes other than ``taken`` (another pool's, see
        ``pick_nodes``). On the CPU a node's cores are shared by the ``cpu_ranks_per_node`` ranks of
        every pool on it."""
        self.pool, self.world_size = pool, pool.size
        resource = DEVICE_RESOURCE[device]
        nodes = pick_nodes(ray.nodes(), pool.nnodes, pool.devices_per_node, resource, pool.keys, taken)
        # rank r runs on node r // devices_per_node: what a message about rank r names
        self.node_ips = [n["NodeManagerAddress"] for n in nodes for _ in range(pool.devices_per_node)]
        cpus_per_worker = 1
        if resource is None:  # CPU: share each node's cores between its ranks
            cpus_per_worker = max(1, min(int(n["Resources"].get("CPU", 1)) for n in nodes) // cpu_ranks_per_node)
        bundle = {"CPU": cpus_per_worker, **({resource: 1} if resource else {})}
        # One STRICT_PACK group per node, pinned to it (Ray's node:<ip> resource): the ranks of a
        # node stay together and no two groups of a pool share a node, as the layout assumes.
        self.groups = [placement_group([{**bundle, f"node:{n['NodeManagerAddress']}": 0.001}] * pool.devices_per_node,
                                       strategy="STRICT_PACK") for n in nodes]
        ready = ray.wait([g.ready() for g in self.groups], num_returns=len(self.groups), timeout=PLACEMENT_TIMEOUT_S)[0]
        if len(ready) < len(self.groups):
            self.close()
            raise ClusterError(
                f"Ray could place only {len(ready)} of {pool.nnodes} nodes' {pool.label}s within {PLACEMENT_TIMEOUT_S}s: "
                f"each node needs {pool.devices_per_node} x {bundle}; the cluster has {ray.cluster_resources()}. "
                f"Check {pool.keys} against the nodes that joined"
            )
        # a rollout rank of its own runs some calls beside the others (``CONCURRENT``)
        self.concurrent = CONCURRENT if pool.roles == Roles.ROLLOUT else {}
        remote = ray.remote(concurrency_groups=self.concurrent)(Rank) if self.concurrent else ray.remote(Rank)
        self.workers = [
            remote.options(
                num_cpus=cpus_per_worker,
                **device_options(device),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=local),
            ).remote(node * pool.devices_per_node + local, self.world_size, pool.roles)
            for node, group in enumerate(self.groups)
            for local in range(pool.devices_per_node)
        ]
        self.infos: list[RankInfo] = []

    def setup(self, settings: RankSettings, model_dir: str) -> list[RankInfo]:
        self.infos = self.get(self.start_setup(settings, model_dir), "start-up")
        return self.infos

    def start_setup(self, settings: RankSettings, model_dir: str) -> list:
        """Every worker's ``setup`` in the pool's torch.distributed world (rank 0 hosts its
        rendezvous), without waiting: their refs for ``get``."""
        addr, port = self.get([self.workers[0].address.remote()], "start-up")[0]
        return [w.setup.remote(settings, model_dir, addr, port) for w in self.workers]

    def call(self, method: Callable, args: Sequence[tuple] | None = None, phase: str | None = None) -> list[Any]:
        """``method`` (of ``Rank``) on every worker (with its own ``args`` if given), all at once;
        their results."""
        return self.get(self.submit(method, args), phase or method.__name__)

    def submit(self, method: Callable, args: Sequence[tuple] | None = None) -> list:
        """``method`` (of ``Rank``) on every worker, all at once, without waiting: their refs for ``get``."""
        name, args = method.__name__, args or [()] * self.world_size
        calls = [getattr(w, name) for w in self.workers]
        if name in self.concurrent:
            calls = [c.options(concurrency_group=name) for c in calls]
        return [c.remote(*a) for c, a in zip(calls, args)]

    def get(self, refs: list, phase: str, timeout_s: float | None = None) -> list[Any]:
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            late = [self._describe(r) for r, ref in enumerate(refs) if not ray.wait([ref], timeout=0)[0]]
            raise WorkerTimeoutError(f"{', '.join(late) or 'a worker'} did not answer {phase} within {timeout_s:g} s") from None
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(f"{self._who(refs, ray.exceptions.RayActorError)} died during {phase}: "
                                  f"{e.__class__.__name__}") from e
        except ray.exceptions.RayTaskError as e:
            if not isinstance(e.cause, NAMED_ERRORS):
                raise
            e.cause.add_note(f"raised by {self._who(refs, ray.exceptions.RayTaskError)} during {phase}")
            raise e.cause from None

    def _who(self, refs: list, error: type) -> str:
        """The workers whose call ended in ``error``. Every finished call's result is read, so Ray
        does not report the other workers' errors again as unhandled when the run ends."""
        ray.wait(refs, num_returns=len(refs), timeout=PEERS_TIMEOUT_S)
        return ", ".join(self._describe(r) for r, ref in enumerate(refs) if _failed(ref, error)) or "a worker"

    def _describe(self, rank: int) -> str:
        return f"{self.pool.label} rank {rank} on node {self.node_ips[rank]}"

    def close(self) -> None:
        for worker in getattr(self, "workers", []):
            ray.kill(worker)
        for group in self.groups:
            remove_placement_group(group)


def first_failure(refs: list, until: list):
    """Wait until every call of ``until`` (some of ``refs``) has ended, or one of ``refs`` has
    failed: that one, else None. Calls still running then are the caller's."""
    pending, awaited = list(refs), set(until)
    while awaited.intersection(pending):
        (ended,), pending = ray.wait(pending, num_returns=1)
        if _failed(ended, Exception):
            return ended
    return None


def any_died(refs: list, within_s: float) -> bool:
    """Whether Ray reports the worker of one of ``refs`` dead (``RayActorError``) within
    ``within_s``: it learns of a process's end a moment after the process's sockets close, so a peer
    in a collective with it may fail first."""
    deadline, pending = time.monotonic() + within_s, list(refs)
    while pending and (left := deadline - time.monotonic()) > 0:
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if ready and _failed(ready[0], ray.exceptions.RayActorError):
            return True
    return False


def _failed(ref, error: type) -> bool:
    try:
        ray.get(ref, timeout=0)
    except error:
        return True
    except Exception:  # noqa: BLE001  (another error or not finished: not this worker's)
        return False
    return False
