"""What the shell launchers (``launch/common.sh``) ask Python for: the recipe checked for the
cluster before anything starts, the job's runtime env, and waiting for the nodes to join.

``python -m recipe.cluster prepare``    load the recipe exactly as the job will (launcher inputs
                                        and ``key=value`` overrides), print the inputs, the layout,
                                        memory per device and MC2 plan, and write into ``--out-dir``:
                                        ``runtime_env.yaml``, ``job_args`` (one argument a line) and
                                        ``cluster.env`` (the resolved values, for the shell to source)
``python -m recipe.cluster wait-nodes`` wait until every node joined the Ray cluster; on time-out
                                        name how many joined and which are missing
``python -m recipe.cluster job-status`` print a job's final status; exit 0 only if it succeeded

Exit status: 0 done, 1 a node or a file is missing, 2 an invalid config or layout (the planner's
messages).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Sequence
from pathlib import Path

import yaml

from megatron_bridge.atomic import write_text
from megatron_bridge.configs import CONFIGS_DIR
from megatron_bridge.errors import ConfigError
from recipe.config import builtin_task, deep_merge, parse_overrides, read_yaml
from recipe.run_dir import check_free
from recipe.config.verl import MISSING, get_dotted

RUNTIME_ENV_DIR = os.path.join(CONFIGS_DIR, "runtime_env")
RUNTIME_ENV_FOR_DEVICE = {"npu": "mc2.yaml", "cuda": "base.yaml", "cpu": "base.yaml"}


class MissingError(RuntimeError):
    """A file or node the run needs is not there."""


# ---- prepare ---------------------------------------------------------------------------------


def _absolute(path: str) -> str:
    """Paths go to the job absolute, so they mean the same wherever Ray runs it."""
    return path if builtin_task(path) else os.path.abspath(path)


def launcher_overrides(args: argparse.Namespace) -> list[str]:
    """The launcher's environment inputs as recipe overrides (values as JSON, which YAML reads
    back unchanged whatever characters a path holds)."""
    out = []
    if args.nnodes:
        out.append(f"trainer.nnodes={args.nnodes}")
    if args.devices_per_node:
        out.append(f"trainer.n_gpus_per_node={args.devices_per_node}")
    if args.parallel:
        out.append(f"parallel={json.dumps(_absolute(args.parallel) if os.path.exists(args.parallel) else args.parallel)}")
    if args.model_path:
        out.append(f"actor_rollout_ref.model.path={json.dumps(_absolute(args.model_path))}")
    for key, value in (("data.train_files", args.train_file), ("data.val_files", args.val_file)):
        if value:
            out.append(f"{key}={json.dumps([_absolute(p) for p in value.split(',') if p])}")
    if args.ckpt_dir:
        out.append(f"trainer.default_local_dir={json.dumps(_absolute(args.ckpt_dir))}")
    return out + rollout_pool_overrides(args)


def rollout_pool_overrides(args: argparse.Namespace) -> list[str]:
    """ROLLOUT_NNODES / ROLLOUT_NPUS_PER_NODE: the rollout on nodes of its own, which runs with
    one_step_off (unless the user's overrides choose the mode themselves)."""
    if not args.rollout_nnodes:
        return []
    out = ["actor_rollout_ref.hybrid_engine=false", f"actor_rollout_ref.rollout.nnodes={args.rollout_nnodes}",
           f"actor_rollout_ref.rollout.n_gpus_per_node={args.rollout_devices_per_node}"]
    if get_dotted(parse_overrides(args.overrides), "async_training.mode") is MISSING:
        out.append("async_training.mode=one_step_off")
    return out


def check_rollout_pool_inputs(recipe: str, args: argparse.Namespace) -> None:
    """ROLLOUT_* give the rollout nodes of its own (hybrid_engine=false): a recipe, or an override,
    that keeps it on the training devices (hybrid_engine=true) contradicts them."""
    if not args.rollout_nnodes:
        return
    given = deep_merge(read_yaml(recipe), parse_overrides(args.overrides))
    if get_dotted(given, "actor_rollout_ref.hybrid_engine") is True:
        raise ConfigError(
            f"ROLLOUT_NNODES={args.rollout_nnodes} / ROLLOUT_NPUS_PER_NODE={args.rollout_devices_per_node} give the "
            f"rollout nodes of its own, but the recipe {recipe} or an override sets actor_rollout_ref.hybrid_engine=true "
            "(the rollout on the training devices): unset ROLLOUT_NNODES and ROLLOUT_NPUS_PER_NODE, or drop that key"
        )


def runtime_env(template: str, mc2_plan, user_buffsize: str | None) -> tuple[dict, list[str]]:
    """The template's runtime env with HCCL_BUFFSIZE from the planner unless the user set it
    (in the environment or the template); notes to print."""
    try:
        with open(template) as f:
            env = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"runtime env {template}: {e}") from e
    env_vars = env.get("env_vars", {}) if isinstance(env, dict) else None
    if not isinstance(env_vars, dict):
        raise ConfigError(f"runtime env {template}: expected a mapping with an env_vars mapping (Ray's runtime_env format)")
    env_vars = {str(k): str(v) for k, v in env_vars.items()}
    notes = []
    user_buffsize = user_buffsize or env_vars.get("HCCL_BUFFSIZE")
    if user_buffsize:
        if not user_buffsize.isdigit():
            raise ConfigError(f"HCCL_BUFFSIZE={user_buffsize!r}: expected a whole number of MB")
        env_vars["HCCL_BUFFSIZE"] = user_buffsize
        if mc2_plan.applies and int(user_buffsize) < mc2_plan.needed_buffsize_mb:
            notes.append(f"warning: HCCL_BUFFSIZE={user_buffsize} MB is below the {mc2_plan.needed_buffsize_mb} MB "
                         "MC2 needs for this layout; vLLM-Ascend then fails with 'DDR address out of range'")
        else:
            notes.append(f"HCCL_BUFFSIZE={user_buffsize} MB (yours; the planner's value: {mc2_plan.hccl_buffsize_mb} MB)")
    elif mc2_plan.applies and mc2_plan.needed_buffsize_mb:
        env_vars["HCCL_BUFFSIZE"] = str(mc2_plan.hccl_buffsize_mb)
        notes.append(f"HCCL_BUFFSIZE={mc2_plan.hccl_buffsize_mb} MB (the planner's, for MC2 in this layout)")
    return {**env, "env_vars": env_vars}, notes


def missing_paths(cfg, role: str) -> list[str]:
    """Inputs that are not on this node: the head's driver reads the data, every node the model."""
    model = cfg.actor_rollout_ref.model.path
    wanted = [("actor_rollout_ref.model.path", model)]
    if role == "head":
        wanted += [("data.train_files", p) for p in cfg.data.train_files]
        wanted += [("data.val_files", p) for p in cfg.data.val_files]
    return [f"{key}={path!r} does not exist on this node" for key, path in wanted
            if not builtin_task(path) and not os.path.exists(path)]


def check_node_addresses(head_ip: str, node_ips: str, needed: int) -> None:
    """NODE_IPS, when given, lists the run's nodes once each, the head (MASTER_ADDR) among them:
    what the join wait names as missing and the pools are described from."""
    if not node_ips:
        return
    ips = [ip.strip() for ip in node_ips.split(",") if ip.strip()]
    if len(set(ips)) < len(ips):
        raise ConfigError(f"NODE_IPS={node_ips}: an address is listed twice; list each node once")
    if len(ips) != needed:
        raise ConfigError(f"NODE_IPS={node_ips} lists {len(ips)} address(es) but the run takes {needed} node(s) "
                          "(NNODES, plus ROLLOUT_NNODES for a rollout pool of its own): list exactly the run's nodes")
    if head_ip not in ips:
        raise ConfigError(f"NODE_IPS={node_ips} does not list the head {head_ip} (MASTER_ADDR, resolved): set "
                          "MASTER_ADDR to the head node's address, one of NODE_IPS, the same on every node")


def describe_pools(cfg, head_ip: str, node_ips: str) -> list[str]:
    """Which nodes train and which generate, as the run will pick them (``pick_nodes``: the head
    first, then by address; the rollout pool on nodes the training pool does not hold). Named from
    NODE_IPS when it lists them all; nothing for a colocated rollout."""
    from recipe.workers.group import (DEVICE_RESOURCE, HEAD_RESOURCE, devices_per_node_offered, nodes_needed,
                                      pick_nodes, pools)

    training, rollout = pools(cfg.layout)
    if rollout is None:
        return []
    device, needed = cfg.layout.cluster.device, nodes_needed(cfg.layout)
    out = [f"pools (actor_rollout_ref.hybrid_engine=false, async_training.mode={cfg.async_training.mode}): "
           f"{needed} node(s)"]
    resource = DEVICE_RESOURCE[device]
    ips = list(dict.fromkeys(ip for ip in [head_ip, *node_ips.split(",")] if ip))
    if resource is None:
        return out + [f"  training: {training.nnodes} x {training.devices_per_node} CPU ranks, rollout: "
                      f"{rollout.nnodes} x {rollout.devices_per_node} CPU ranks, on the same node(s)' cores"]
    if len(ips) < needed:
        return out + [f"  training: {training.nnodes} x {training.devices_per_node} {device}, the head first; "
                      f"rollout: {rollout.nnodes} x {rollout.devices_per_node} {device} on {rollout.nnodes} other "
                      "node(s) (set NODE_IPS=ip1,ip2,... to have them named)"]
    offered = devices_per_node_offered(cfg.layout)
    nodes = [{"NodeManagerAddress": ip, "Alive": True,
              "Resources": {resource: offered, **({HEAD_RESOURCE: 1} if ip == head_ip else {})}} for ip in ips]
    trains = [n["NodeManagerAddress"] for n in pick_nodes(nodes, training.nnodes, training.devices_per_node, resource)]
    generates = [n["NodeManagerAddress"] for n in pick_nodes(nodes, rollout.nnodes, rollout.devices_per_node,
                                                              resource, taken=trains)]
    return out + [f"  training: {training.nnodes} x {training.devices_per_node} {device} on {', '.join(trains)}",
                  f"  rollout:  {rollout.nnodes} x {rollout.devices_per_node} {device} on {', '.join(generates)}"]


def prepare(args: argparse.Namespace) -> int:
    from megatron_bridge.plan.verdict import print_verdict
    from recipe.config import actor_budget, config_to_dict, layout_verdict, load_config, model_spec, resolve_path
    from recipe.workers.group import DEVICE_RESOURCE, devices_per_node_offered, nodes_needed

    recipe = os.path.abspath(resolve_path("recipe", args.recipe))
    check_rollout_pool_inputs(recipe, args)
    overrides = launcher_overrides(args) + list(args.overrides)
    cfg = load_config(recipe, overrides + ([f"algo={args.algo}"] if args.algo else []))
    cluster = cfg.layout.cluster
    run_dir = os.path.abspath(cfg.trainer.default_local_dir)
    model = cfg.actor_rollout_ref.model
    print(f"recipe {recipe} (algo {cfg.algo}, parallel {cfg.parallel})")
    for name, value in (("NNODES", cluster.nnodes), ("NPUS_PER_NODE", cluster.devices_per_node),
                        ("MODEL_PATH", model.path), ("TRAIN_FILE", ",".join(cfg.data.train_files)),
                        ("VAL_FILE", ",".join(cfg.data.val_files)), ("CKPT_DIR", run_dir)):
        print(f"  {name:<14} {value}")
    check_node_addresses(args.head_ip, args.node_ips, nodes_needed(cfg.layout))
    for line in describe_pools(cfg, args.head_ip, args.node_ips):
        print(line)
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    spec = model_spec(cfg, recipe)
    verdict = layout_verdict(cfg, spec)
    print_verdict(spec, verdict, seq_len, actor_budget(cfg))

    template = args.runtime_env or os.path.join(RUNTIME_ENV_DIR, RUNTIME_ENV_FOR_DEVICE[cluster.device])
    env, notes = runtime_env(template, verdict.mc2, args.hccl_buffsize)
    for note in notes:
        print(note)
    problems = missing_paths(cfg, args.role)
    for problem in problems:
        print(f"{'warning' if args.dry_run else 'error'}: {problem}", file=sys.stderr)
    if problems and not args.dry_run:
        raise MissingError(f"{len(problems)} input(s) missing on this node (above); fix the paths or the environment variables")
    if args.role == "head" and not args.dry_run:
        check_free(Path(run_dir))  # the job's driver holds it; refused here, before any node waits

    os.makedirs(args.out_dir, exist_ok=True)
    write_text(os.path.join(args.out_dir, "runtime_env.yaml"), yaml.safe_dump(env, sort_keys=False))
    write_text(os.path.join(args.out_dir, "job_args"), "\n".join(["--config", recipe] + overrides) + "\n")
    write_text(os.path.join(args.out_dir, "config.yaml"), yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    pool = cfg.layout.rollout if cfg.layout.separate_rollout else None
    resolved = {
        "NNODES": cluster.nnodes, "NPUS_PER_NODE": cluster.devices_per_node, "DEVICE": cluster.device,
        "ROLLOUT_NNODES": (pool.nnodes or 1) if pool else "", "ROLLOUT_NPUS_PER_NODE": pool.devices_per_node if pool else "",
        "ALL_NODES": nodes_needed(cfg.layout), "NODE_DEVICES": devices_per_node_offered(cfg.layout),
        "DEVICE_RESOURCE": DEVICE_RESOURCE[cluster.device] or "", "RUN_DIR": run_dir,
        "EXPERIMENT": cfg.trainer.experiment_name, "HCCL_BUFFSIZE_MB": env["env_vars"].get("HCCL_BUFFSIZE", ""),
    }
    write_text(os.path.join(args.out_dir, "cluster.env"),
           "".join(f"{k}={shlex.quote(str(v))}\n" for k, v in resolved.items()))
    return 0


# ---- wait-nodes ------------------------------------------------------------------------------


def alive_nodes(dashboard: str) -> list:
    from ray.util.state import list_nodes

    return list(list_nodes(address=dashboard, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False))


def _describe(node, resource: str | None) -> str:
    have = f", {int(node.resources_total.get(resource, 0))} {resource}" if resource else ""
    return f"{node.node_ip}{have}"


def join_report(nodes: Sequence, expect: int, node_ips: Sequence[str], resource: str | None, per_node: int,
                address: str, timeout_s: float) -> str | None:
    """None when all ``expect`` nodes joined with their devices, else what is wrong."""
    joined = sorted(_describe(n, resource) for n in nodes)
    if len(nodes) < expect:
        ips = {n.node_ip for n in nodes}
        missing = [ip for ip in node_ips if ip not in ips]
        named = (f"missing: {', '.join(missing)}" if missing else
                 f"missing: {expect - len(nodes)} node(s) (set NODE_IPS=ip1,ip2,... to have them named)")
        return (f"only {len(nodes)} of {expect} nodes joined the Ray cluster at {address} within {timeout_s:g} s; "
                f"joined: {', '.join(joined) or 'none'}; {named}. On each missing node run the same launcher "
                f"with MASTER_ADDR set to this node, and check that it reaches {address}")
    short = [n.node_ip for n in nodes if resource and n.resources_total.get(resource, 0) < per_node]
    if short:
        return (f"node(s) {', '.join(short)} offer fewer than the {per_node} {resource} per node the layout needs "
                f"(joined: {', '.join(joined)}); check NPUS_PER_NODE and the visible devices on those nodes")
    return None


def wait_nodes(args: argparse.Namespace) -> int:
    node_ips = [ip for ip in (args.node_ips or "").split(",") if ip]
    deadline = time.monotonic() + args.timeout
    nodes: list = []
    error: Exception | None = None
    seen = -1
    while True:
        try:
            nodes, error = alive_nodes(args.dashboard), None
        except Exception as e:  # noqa: BLE001  (the dashboard may still be starting: ask again until the deadline)
            error = e
        if len(nodes) != seen:
            seen = len(nodes)
            print(f"nodes joined: {seen}/{args.expect} ({', '.join(sorted(n.node_ip for n in nodes)) or 'none yet'})", flush=True)
        if len(nodes) >= args.expect or time.monotonic() >= deadline:
            break
        time.sleep(args.poll)
    if not nodes and error is not None:
        print(f"error: the Ray dashboard at {args.dashboard} did not answer within {args.timeout:g} s: {error}", file=sys.stderr)
        return 1
    problem = join_report(nodes, args.expect, node_ips, args.resource or None, args.per_node, args.address, args.timeout)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    print(f"all {args.expect} node(s) joined: {', '.join(sorted(_describe(n, args.resource or None) for n in nodes))}")
    return 0


def job_status(args: argparse.Namespace) -> int:
    from ray.job_submission import JobStatus, JobSubmissionClient

    status = JobSubmissionClient(args.dashboard).get_job_status(args.id)
    print(status.value)
    return 0 if status == JobStatus.SUCCEEDED else 1


# ---- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recipe.cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="check the recipe for the cluster and write the job's inputs")
    p.add_argument("--recipe", required=True, help="recipe YAML or shipped name")
    p.add_argument("--algo", default="", help="gspo | grpo: as recipe.main_<algo> sets it")
    p.add_argument("--role", choices=("head", "worker"), default="head", help="which inputs must exist on this node")
    p.add_argument("--out-dir", required=True, help="where runtime_env.yaml, job_args, config.yaml, cluster.env go")
    p.add_argument("--dry-run", action="store_true", help="missing input files are warnings, not errors")
    for name, what in (("nnodes", "NNODES"), ("devices-per-node", "NPUS_PER_NODE"), ("parallel", "PARALLEL"),
                       ("model-path", "MODEL_PATH"), ("train-file", "TRAIN_FILE (comma-separated for several)"),
                       ("val-file", "VAL_FILE"), ("ckpt-dir", "CKPT_DIR"), ("hccl-buffsize", "HCCL_BUFFSIZE (MB)"),
                       ("runtime-env", "RUNTIME_ENV template"), ("rollout-nnodes", "ROLLOUT_NNODES"),
                       ("rollout-devices-per-node", "ROLLOUT_NPUS_PER_NODE"), ("head-ip", "MASTER_ADDR, resolved"),
                       ("node-ips", "NODE_IPS")):
        p.add_argument(f"--{name}", default="", help=f"the launcher's {what}; empty: the recipe's own")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="recipe overrides, after the launcher's")
    w = sub.add_parser("wait-nodes", help="wait until the cluster has all its nodes")
    w.add_argument("--dashboard", required=True, help="the head's dashboard URL, e.g. http://127.0.0.1:8265")
    w.add_argument("--address", required=True, help="the head's GCS address, for the messages")
    w.add_argument("--expect", type=int, required=True, help="number of nodes")
    w.add_argument("--timeout", type=float, required=True, help="seconds")
    w.add_argument("--resource", default="", help="Ray resource of one device (NPU, GPU); empty: none checked")
    w.add_argument("--per-node", type=int, default=0, help="devices each node must offer")
    w.add_argument("--node-ips", default="", help="comma-separated addresses of all nodes, to name the missing ones")
    w.add_argument("--poll", type=float, default=2.0, help="seconds between looks")
    j = sub.add_parser("job-status", help="a job's status (exit 0: SUCCEEDED)")
    j.add_argument("--dashboard", required=True, help="the head's dashboard URL")
    j.add_argument("--id", required=True, help="the submission id")
    return parser


COMMANDS = {"prepare": prepare, "wait-nodes": wait_nodes, "job-status": job_status}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MissingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
