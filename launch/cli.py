"""trinity-launch (python -m launch) plan|run|doctor: plan a split over unequal hosts, start the ranks,
say before they start what will break.

    trinity-launch plan --preset trinity-mini --memory-gb 48,10.5 [--context N] [--json]
    trinity-launch plan --model PATH_OR_REPO --hostfile hosts.json [--context N] [--json]
    trinity-launch run --hostfile hosts.json [--dry-run] -- run-trinity --model … --prompt …
    trinity-launch run --single-host 2 [--restart N] -- run-trinity --serve 127.0.0.1:50051
    trinity-launch doctor --hostfile hosts.json [--model PATH_OR_REPO] [--json]

Ring-backend rings are started by us, without mlx.launch (whose output loop keeps
a core busy): local ranks (127.0.0.1) directly, remote hosts over ssh (--ssh, or
$TRINITY_SSH, says how to call ssh). --via mlx.launch uses mlx.launch anyway;
other backends always do. --restart N starts the whole ring again after a rank
fails, up to N times; then --replan (on with --restart) plans a remote host that
no longer answers out of the ring and goes on with the rest (launch/replan.py).
With --serve, the front ends (--serve, --http) run here, in a router in front of
rank 0 that replays in-flight requests on the restarted ring (launch/router/);
--no-router leaves them on rank 0. `doctor` checks every host over the same ssh (launch/doctor.py)
and measures the links, which `plan` and `run` then use (launch/links.py); `run` first runs
the doctor's fast checks (versions, memory, ports) on remote hosts.
"""

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import List, Optional

from distributed import TrinityError, logs
from distributed.command_line import HelpFormatter, kv_arguments, read_command
from distributed.shard.memory import DEFAULT_MARGIN, usable_memory_bytes
from distributed.shard.sizes import quantize_config, with_kv_quantization

from . import bundled, hostfile, mlx_launch_ring, runner
from .host_set import HostSet
from .replan import DoesNotFit, Planner, Replanner, make_plan
from .ssh_ring import SSH_ENV, SSH_OPTIONS, ssh_command

RUN_SCRIPT = "run-trinity"  # the console script of run_trinity.py
EPILOG = """\
examples:
  trinity-launch plan --preset trinity-mini --quantize 4 --hostfile thunderbolt-ring-2macs
  trinity-launch run --single-host 2 -- run-trinity --prompt "Hi"
  trinity-launch run --hostfile hosts.json --restart 3 -- run-trinity --model REPO --serve 127.0.0.1:50051
  trinity-launch doctor --hostfile hosts.json --model REPO

presets and example hostfiles are bundled (`--preset NAME`, `--hostfile NAME`; launch/configs/README.md);
more in the docs (docs/, a site: `mkdocs serve`), pages "launcher.md" (planning the split, hostfiles,
restarts) and "command-line.md" (every flag)."""
SAMPLING_FLAGS = {"temperature": ("--temp", "temp"), "top_k": ("--top-k", "top_k"), "top_p": ("--top-p", "top_p"),
                  "min_p": ("--min-p", "min_p")}  # a preset's sampling key: run-trinity's flag, its dest


def _remote_args(p: argparse.ArgumentParser) -> None:
    """How hosts are reached: the ranks' interpreter and ssh (run, doctor, plan --measure-links)."""
    p.add_argument("--python", help=f"interpreter for a .py or {RUN_SCRIPT} command, and for the doctor's "
                   "probes (default: this one)")
    p.add_argument("--ssh", metavar="CMD", help="how to call ssh for remote hosts (not with mlx.launch, which "
                   f"runs plain ssh): a command line, default ${SSH_ENV} or else ssh, e.g. "
                   f"\"ssh -F ~/.ssh/trinity_config\" or \"ssh -p 2222 -i ~/.ssh/id_trinity\"; "
                   f"{' '.join(SSH_OPTIONS)} are added after it")


def _links_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--measure-links", action="store_true", help="measure the links between consecutive ranks "
                   "now (a ring of launch/link_probe.py) instead of the last `trinity-launch doctor` run's, "
                   "or the assumed ones when there is none")


def _hosts_args(p: argparse.ArgumentParser, plan: bool) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--hostfile", help="mlx.launch hostfile (JSON; per host optional memory_gb and speed), or the "
                   f"name of a bundled example ({', '.join(bundled.names('hostfile'))})")
    g.add_argument("--single-host", type=int, metavar="N", help="N ranks on this machine")
    if plan:
        g.add_argument("--memory-gb", help="memory per host in GiB, e.g. 64,16 (no hostfile needed)")
    p.add_argument("--backend", help="override the hostfile's backend (ring, mpi, nccl, jaccl, jaccl-ring)")
    p.add_argument("--preset", help=f"a bundled preset ({', '.join(bundled.names('preset'))}) or a preset file")
    p.add_argument("--context", type=int, help="target tokens per request, prompt + generation "
                   "(default: run_trinity's --max-context, else the preset's, else max_position_embeddings)")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="share of each host's memory kept free")


def build_parser() -> argparse.ArgumentParser:
    prog = "python -m launch" if sys.argv[0].endswith("__main__.py") else None  # else trinity-launch's name
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0], epilog=EPILOG,
                                formatter_class=HelpFormatter)
    p.add_argument("--log-level", choices=logs.LEVELS, default="info", help="stderr's threshold (distributed/logs.py)")
    sub = p.add_subparsers(dest="verb", required=True)
    plan = sub.add_parser("plan", help="print the layer split per host", formatter_class=HelpFormatter)
    _hosts_args(plan, plan=True)
    plan.add_argument("--model", help="checkpoint folder or Hugging Face repo id (only config.json and "
                      "safetensors headers are read); default: the preset's config, else the embedded tiny model")
    plan.add_argument("--quantize", type=int, metavar="BITS", help="plan as if converted by mlx-lm at BITS "
                      "(group 64, routers at 8 bits), for a config that is not quantized")
    plan.add_argument("--draft-model", metavar="PATH_OR_REPO", help="plan rank 0 with run_trinity's --draft-model "
                      "beside its layers (its weights and caches; only its config.json is read); a preset's name "
                      "plans with its config, quantized as --quantize says")
    plan.add_argument("--tensor-parallel-size", type=int, default=1, metavar="T", help="plan run-trinity's "
                      "--tensor-parallel-size T: each host 1/T of its group's layers, groups placed by the links; "
                      "without it the plan also says which size the speed model advises for one chat")
    plan.add_argument("--json", action="store_true", help='print {"fits", "hosts": [...]} as JSON')
    kv_arguments(plan)  # run-trinity's --kv-bits: planned with the bytes its caches then take
    _links_args(plan)
    _remote_args(plan)
    run = sub.add_parser("run", help="plan, then start the ranks (ring backend: ourselves, locally or over "
                         "ssh; others through mlx.launch)", formatter_class=HelpFormatter)
    _hosts_args(run, plan=False)
    run.add_argument("--dry-run", action="store_true", help="print the plan and the exact command, start nothing")
    run.add_argument("--no-plan", action="store_true", help="start the command as it is (no --split added)")
    run.add_argument("--starting-port", type=int, help="ring backend: first port (mlx.launch's --starting-port)")
    _remote_args(run)
    _links_args(run)
    run.add_argument("--no-checks", action="store_true", help="skip the doctor's fast checks (versions, memory, "
                     "ports) on remote hosts before starting")
    run.add_argument("--restart", type=int, default=0, metavar="N",
                     help="after a rank fails, stop what is left of the ring and start the whole ring "
                          "again, up to N times (then exit with the last failure's status)")
    run.add_argument("--grace", type=float, default=20.0, metavar="S",
                     help="seconds the other ranks get to exit on their own after a rank fails or after "
                          "a stop signal, before SIGTERM (then SIGKILL 3 s later); default 20")
    run.add_argument("--replan", action=argparse.BooleanOptionalAction, default=None,
                     help="once the restarts are spent, probe the remote hosts (TCP to each ring IP's ssh port); "
                          "drop those that do not answer, plan the split again over the rest and start the ring "
                          "there (a fresh --restart budget), or exit naming the lost host when the model does not "
                          "fit on the rest; default: on when --restart > 0")
    run.add_argument("--restart-delay", type=float, default=1.0, metavar="S", help="pause before a restart")
    run.add_argument("--via", choices=["auto", "direct", "mlx.launch"], default="auto",
                     help="auto: with the ring backend start the ranks ourselves (local ones directly, remote "
                          "ones over ssh; mlx.launch's output loop keeps a core busy), other backends through "
                          "mlx.launch; direct: insist on starting them ourselves; mlx.launch: always through it")
    run.add_argument("--cwd", help="working directory of every rank (default: ours, on each host that has it, "
                     "as mlx.launch does); a host without it fails")
    run.add_argument("--no-router", action="store_true",
                     help="with --serve: serve from rank 0 itself, as mlx.launch would (default: a router in this "
                          "process serves --serve and --http, forwards to rank 0, and replays in-flight requests "
                          "on the restarted ring after a failure, so clients see a pause, not an error)")
    run.add_argument("command", nargs=argparse.REMAINDER, help=f"-- {RUN_SCRIPT} … (or run_trinity.py …)")
    doctor_parser(sub)
    return p


def doctor_parser(sub) -> None:
    doctor = sub.add_parser("doctor", help="check every host before a ring starts (versions, memory, disk, model "
                            "files, ports, firewall, backend) and measure the links", formatter_class=HelpFormatter)
    _hosts_args(doctor, plan=False)
    doctor.add_argument("--model", help="checkpoint folder or Hugging Face repo id the run will use: its files on "
                        "each host, each host's planned share of memory and disk (default: the preset's)")
    doctor.add_argument("--memory-gb", help="memory per host in GiB the plan may use, e.g. 64,16 (instead of the "
                        "hostfile's memory_gb, else what each host measures)")
    doctor.add_argument("--starting-port", type=int, help="the ring's first port, as `run` will use it "
                        "(default: free ones here)")
    doctor.add_argument("--no-links", action="store_true", help="skip measuring the links (no ring is started)")
    doctor.add_argument("--json", action="store_true", help="print every host's checks and the links as JSON")
    _remote_args(doctor)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.verb == "run":
        args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not args.command:
            p.error("run needs a command after --, e.g. -- run-trinity --prompt Hi")
        if args.restart < 0:
            p.error(f"--restart must be >= 0, got {args.restart}")
        if args.grace < 0 or args.restart_delay < 0:
            p.error("--grace and --restart-delay must be >= 0")
    return args


def load_preset(name: Optional[str]) -> dict:
    if not name:
        return {}
    return json.loads(bundled.resolve("preset", name).read_text())


def load_hosts(args, memory_gb: Optional[str] = None) -> hostfile.Hostfile:
    """The hosts of --hostfile, --single-host or (`plan`) --memory-gb."""
    if args.hostfile:
        return hostfile.load(bundled.resolve("hostfile", args.hostfile), args.backend)
    if memory_gb:
        gbs = gib_list(memory_gb)
        return hostfile.parse([{"ssh": f"host{i}", "ips": [f"10.0.0.{i + 1}"], "memory_gb": g}
                               for i, g in enumerate(gbs)], "--memory-gb")
    hf = hostfile.local_hosts(args.single_host)
    hf.backend = args.backend or hf.backend
    return hostfile.check(hf, "--single-host")


def fill_local_memory(hf: hostfile.Hostfile) -> None:
    """Measure this machine for the local ranks the hostfile gives no memory; they share it."""
    local = [h for h in hf.hosts if h.is_local and h.memory_bytes is None]
    if local:
        share = usable_memory_bytes() // len(local)
        for h in local:
            h.memory_bytes = share


def choose_context(*candidates, config: dict) -> int:
    """The first context given, never past what the model allows."""
    limit = config.get("max_position_embeddings")
    context = next((int(c) for c in candidates if c), None) or limit or 4096
    return min(context, limit) if limit else context


def model_config(args, preset: dict):
    """(label, config, exact tensor sizes or None) of --model, else the preset's config, else
    the preset's model, else the embedded tiny model."""
    from distributed.shard import checkpoint  # imports mlx_lm (slow): only when planning

    if args.model is None and "config" in preset:
        label, config, sizes = f"preset {args.preset}", preset["config"], None
    else:
        model, path, config = checkpoint.load_config(args.model or preset.get("model"))
        label, sizes = model, checkpoint.tensor_sizes(model, path)
    if getattr(args, "quantize", None):
        config, sizes = quantize_config(config, args.quantize), None
    config = with_kv_quantization(config, getattr(args, "kv_bits", None), getattr(args, "kv_group_size", 64))
    return label, config, sizes


def cmd_plan(args) -> int:
    from distributed.shard.sizes import model_sizes

    preset = load_preset(args.preset)
    label, config, sizes = model_config(args, preset)
    context = choose_context(args.context, preset.get("context"), config=config)
    hf = load_hosts(args, args.memory_gb)
    fill_local_memory(hf)
    unknown = [h for h in hf.hosts if h.memory_bytes is None]
    if unknown:
        h = unknown[0]
        raise TrinityError(f"host {h.ssh} (rank {h.rank}) has no memory_gb in the hostfile; `launch plan` needs "
                           "one per remote host (`launch run` measures it at start-up instead)")
    plan, advice = plan_hosts(args, config, sizes, hf, context)
    longest = longest_contexts(config, plan) if plan.fits and args.tensor_parallel_size == 1 else {}
    if args.json:
        print(json.dumps({**plan.to_json(), "longest_context": longest, "tensor_parallel_size": args.tensor_parallel_size,
                          "kv_bits": args.kv_bits, "advice": advice.to_json(hf)}))
    else:
        layers = model_sizes(config).num_layers
        print(f"{label}: {layers} layers over {len(plan.hosts)} hosts" + (
            f", each 1/{args.tensor_parallel_size} of its group's" if args.tensor_parallel_size > 1 else ""))
        print(plan.describe())
        if len(hf.hosts) > 1:
            print(advice.describe(hf))
        if longest:
            kv = f" with --kv-bits {args.kv_bits}" if args.kv_bits else ""
            print(f"longest context these hosts hold (run_trinity --max-context auto{kv}): "
                  + ", ".join(f"{c} tokens for {b} sequence{'s' if b > 1 else ''}" for b, c in longest.items()))
    if not plan.fits:
        print(f"launch: the model does not fit:\n{plan.shortfall()}", file=sys.stderr)
        return 1
    return 0


def plan_hosts(args, config: dict, sizes, hf: hostfile.Hostfile, context: int):
    """(the memory plan, the tensor-parallel advice): the pipeline's split, or with
    --tensor-parallel-size each host's share of its group (groups placed by the links)."""
    from distributed.shard.sizes import model_args, model_sizes
    from distributed.shard.tensor import check_tensor_size

    from .tensor_plan import advise, place, tensor_plan

    size = args.tensor_parallel_size
    links = choose_links(args, hf, config)
    if size == 1:
        return make_plan(config, sizes, hf, context, args.margin, plan_draft(args)), advise(config, hf, links)
    if len(hf.hosts) % size:
        raise TrinityError(f"--tensor-parallel-size {size} must divide the number of hosts, {len(hf.hosts)}")
    check_tensor_size(model_args(config), size, config.get("quantization"))
    groups = place(hf, config, size, links)
    return tensor_plan(model_sizes(config, sizes), hf, groups, context, args.margin), advise(config, hf, links)


def host_args(args, hf: hostfile.Hostfile) -> List[str]:
    """The hosts as `trinity-launch run` takes them (the doctor's measuring ring)."""
    hosts = ["--hostfile", str(hf.path)] if args.hostfile else ["--single-host", str(len(hf.hosts))]
    return hosts + (["--backend", args.backend] if args.backend else [])


def choose_links(args, hf: hostfile.Hostfile, config: dict):
    """The links the speed model uses: measured now (--measure-links), else the last doctor run's
    for this hostfile, else None (launch/tensor_plan.py's assumed ones)."""
    from . import links

    if len(hf.hosts) < 2:
        return None
    if not getattr(args, "measure_links", False):  # kept per hostfile only: one machine's are its own
        return links.cached(hf) if args.hostfile else None
    if not (args.hostfile or args.single_host):
        raise TrinityError("--measure-links needs real hosts: --hostfile or --single-host")
    from .doctor import Options, measure_links

    options = Options(python=args.python or sys.executable, ssh=ssh_command(args.ssh), launch_args=host_args(args, hf))
    try:
        measured = measure_links(options, int(config.get("hidden_size", 2048)), hf)
    except RuntimeError as e:
        raise TrinityError(f"--measure-links: {e}") from None
    if args.hostfile:
        links.save(hf, measured)
    return links.fresh(measured)


def plan_draft(args):
    """--draft-model for `plan`: a preset's config (quantized as --quantize says), else as given."""
    if not args.draft_model or Path(args.draft_model).exists():
        return args.draft_model
    try:
        preset = load_preset(args.draft_model)
    except TrinityError:
        return args.draft_model  # a folder or a repo id
    return quantize_config(preset["config"], args.quantize) if args.quantize else preset["config"]


def longest_contexts(config: dict, plan, batches=(1, 8, 32)) -> dict:
    """{batch: the longest context at which that many sequences' caches fit beside each
    host's planned weights}, as `--max-context auto` computes it on the ring."""
    from distributed.shard.memory import longest_context

    rows = [{"layers": [h.start, h.end], "parameter_bytes": h.weight_bytes + h.draft_bytes} for h in plan.hosts]
    memory = [h.memory_bytes for h in plan.hosts]
    limit = config.get("max_position_embeddings") or 2**31
    return {b: longest_context(config, rows, memory, b, limit, margin=plan.margin).context for b in batches}


def rank_command(args, preset: dict) -> List[str]:
    """The ranks' command: run-trinity as a module of the ranks' interpreter, with the preset's
    model and sampling where the command gives none (read as run-trinity reads it)."""
    cmd = list(args.command)
    if cmd[0].endswith(".py"):  # mlx.launch runs the command as it is
        cmd.insert(0, args.python or sys.executable)
    elif cmd[0] == RUN_SCRIPT:  # its module, as remote hosts' PATH lacks this environment's bin
        cmd[:1] = [args.python or sys.executable, "-m", "run_trinity"]
    command = read_command(cmd)
    if preset.get("model") and command.settings.model.checkpoint is None:
        cmd += ["--model", preset["model"]]
    for key, (flag, dest) in SAMPLING_FLAGS.items():
        if key in preset.get("sampling", {}) and dest not in command.given:
            cmd += [flag, str(preset["sampling"][key])]
    return cmd


def make_planner(args, preset: dict, hf: hostfile.Hostfile, cmd: List[str]) -> Planner:
    """The memory planner over the model, or (--no-plan, the user's own --split) the command as it is."""
    settings = read_command(cmd).settings
    if args.no_plan or settings.ring.split is not None:
        return Planner(cmd)
    from distributed.shard import checkpoint  # imports mlx_lm (slow): only when planning

    model, path, config = checkpoint.load_config(settings.model.checkpoint)
    config = with_kv_quantization(config, settings.sizing.kv_bits, settings.sizing.kv_group_size)
    max_context = settings.sizing.max_context
    auto = max_context == "auto"  # sized by rank 0 after loading; the plan takes the usual target
    context = choose_context(args.context, None if auto else max_context, preset.get("context"), config=config)
    if max_context is None:  # the ranks then refuse what the plan did not budget for
        cmd = [*cmd, "--max-context", str(context)]
    fill_local_memory(hf)
    sizes = None if any(h.memory_bytes is None for h in hf.hosts) else checkpoint.tensor_sizes(model, path)
    return Planner(cmd, config, sizes, context, args.margin)


def cmd_run(args, host_set: Optional[HostSet] = None) -> int:
    """host_set: where the hosts in use and the lost ones are told (launch/host_set.py), e.g. for a front end."""
    preset = load_preset(args.preset)
    hf = load_hosts(args)
    planner = make_planner(args, preset, hf, rank_command(args, preset))
    router_plan = None
    if not args.no_router:
        from .router.command import plan_router

        router_plan = plan_router(planner.command, hf)
        if router_plan is not None:  # every layout's command serves rank 0 on the internal address
            planner = planner.with_command(router_plan.command)
    try:
        layout = planner.lay_out(hf)
    except DoesNotFit as e:
        print(e.plan.describe(), file=sys.stderr)
        print(f"launch: the model does not fit:\n{e}", file=sys.stderr)
        return 1
    if layout.plan is not None:
        print(layout.plan.describe(), file=sys.stderr)
    elif read_command(layout.command).settings.ring.split == "auto" and planner.config is not None:
        # Some remote host's memory is unknown: the ranks measure, exchange and plan at start-up.
        print("launch: memory_gb missing for " + ", ".join(h.ssh for h in hf.hosts if h.memory_bytes is None)
              + ": the ranks measure it and plan at start-up (--split auto)", file=sys.stderr)
    if planner.config is not None:
        note_tensor_advice(planner, hf, choose_links(args, hf, planner.config))
    if not (args.dry_run or args.no_checks) and not checks_pass(args, hf, layout.plan, planner):
        return 1
    ours = runner.can_start_ourselves(hf, args.backend)
    if args.via == "direct" and not ours:
        raise TrinityError("--via direct needs the ring backend (and an IP for every host); "
                           "use --via mlx.launch (or auto) for other backends")
    ours = ours and args.via != "mlx.launch"
    ssh = ssh_command(args.ssh) if ours else None
    if router_plan is not None and args.dry_run:
        o = router_plan.options
        print(f"launch: router: would serve {o.grpc_address} (gRPC)" + (f" and {o.http_address} (HTTP)"
              if o.http_address else "") + f" here, in front of rank 0 at {router_plan.upstream}", file=sys.stderr)
    if args.dry_run:
        if ours:
            ring = runner.own_ring(layout.command, hf, {}, layout.envs, args.starting_port, ssh, args.cwd)
            print("\n".join(ring.describe_commands()))
        else:
            print(shlex.join(mlx_launch_ring.build_command(
                hf, layout.command, single_host=args.single_host, backend=args.backend,
                starting_port=args.starting_port, envs=layout.envs, cwd=args.cwd)))
        return 0
    replan = args.replan if args.replan is not None else args.restart > 0

    def run(router) -> int:
        # Behind the router, rank 0 serves it on a fresh port each restart, and re-planning may
        # move rank 0 to another host: the router follows it.
        rebind = router.rebind if router is not None else None
        starter = runner.Starter(ours, args.starting_port, ssh, args.cwd, args.single_host, args.backend,
                                 router_plan.envs if router_plan is not None else None, rebind)
        replanner = Replanner(hf, planner, starter, args.restart, host_set, move_rank0=rebind) if replan else None
        return starter.run(hf, layout, args.restart, args.grace, args.restart_delay, replanner, router)

    return _supervised(router_plan, layout.command, run)


def note_tensor_advice(planner, hf: hostfile.Hostfile, links) -> None:
    """A --tensor-parallel-size the speed model finds slower than another choice here (over TCP,
    say) is said before the ranks start (`trinity-launch plan` shows the figures)."""
    size = read_command(planner.command).settings.ring.tensor_parallel_size
    if planner.config is None or len(hf.hosts) < 2:
        return
    from .tensor_plan import advise

    advice = advise(planner.config, hf, links)
    print(f"launch: links for the speed model: {advice.links}", file=sys.stderr)
    if size == 1:
        return
    if advice.choice.tensor != size:
        print(f"launch: note: for one chat over these links the speed model advises {advice.why} "
              "(`trinity-launch plan` shows its figures)", file=sys.stderr)


def checks_pass(args, hf: hostfile.Hostfile, plan, planner) -> bool:
    """The doctor's fast checks (versions, memory, ports) where a remote host or another interpreter
    could differ from here; the failures said, as `trinity-launch doctor` says them."""
    if all(h.is_local for h in hf.hosts) and args.python in (None, sys.executable) and args.starting_port is None:
        return True  # this interpreter, this memory (planned above), ports picked free here
    from . import doctor

    options = doctor.Options(python=args.python or sys.executable, ssh=ssh_command(args.ssh),
                             starting_port=args.starting_port, plan=lambda _: plan)
    failed = doctor.failures(doctor.fast_checks(hf, options))
    for line in failed:
        print(f"launch: check failed: {line}", file=sys.stderr)
    if failed:
        print("launch: error: not starting the ring (`trinity-launch doctor` checks everything; "
              "--no-checks skips these)", file=sys.stderr)
    return not failed


def _supervised(router_plan, cmd: List[str], run) -> int:
    """run(router) under the router when the command serves (launch/router/), else run(None)."""
    if router_plan is None:
        return run(None)
    from .router.router import Router

    router = Router(router_plan, read_command(cmd).settings.model.checkpoint).start()
    try:
        return run(router)
    finally:
        router.close()


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    logs.configure(args.log_level)
    try:
        sys.exit({"plan": cmd_plan, "run": cmd_run, "doctor": cmd_doctor}[args.verb](args))
    except TrinityError as e:
        print(f"launch: error: {e}", file=sys.stderr)
        sys.exit(2)


def gib_list(memory_gb: str) -> List[float]:
    try:
        return [float(x) for x in memory_gb.split(",")]
    except ValueError:
        raise TrinityError(f"--memory-gb {memory_gb!r}: expected GiB per host, e.g. 64,16") from None


def memory_override(hf: hostfile.Hostfile, memory_gb: Optional[str]) -> None:
    """doctor --memory-gb: the memory each host gives the plan, in place of the hostfile's."""
    if not memory_gb:
        return
    gbs = gib_list(memory_gb)
    if len(gbs) != len(hf.hosts):
        raise TrinityError(f"--memory-gb gives {len(gbs)} hosts, the hosts are {len(hf.hosts)}")
    for h, gb in zip(hf.hosts, gbs):
        h.memory_bytes = int(gb * hostfile.GIB)


def doctor_plan(args, preset: dict):
    """The doctor's plan of shares (pipeline split) once each host's memory is known, or None
    without --model or a preset."""
    if not (args.model or preset):
        return None, 2048
    _, config, sizes = model_config(args, preset)
    context = choose_context(args.context, preset.get("context"), config=config)
    return (lambda hf: make_plan(config, sizes, hf, context, args.margin)), int(config.get("hidden_size", 2048))


def cmd_doctor(args) -> int:
    from . import doctor

    preset = load_preset(args.preset)
    hf = load_hosts(args)
    memory_override(hf, args.memory_gb)
    plan, hidden = doctor_plan(args, preset)
    options = doctor.Options(python=args.python or sys.executable, ssh=ssh_command(args.ssh),
                             starting_port=args.starting_port, model=args.model, plan=plan, links=not args.no_links,
                             hidden=hidden, launch_args=host_args(args, hf))
    report = doctor.run(hf, options)
    print(json.dumps(report.to_json()) if args.json else doctor.describe(report))
    return 0 if report.ok else 1
