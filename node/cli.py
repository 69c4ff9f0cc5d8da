"""``echo-node``: the volunteer's program."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import trio
import typer
from rich.console import Console

from echo.node.priority import yield_cpu
from echo.p2p.lifecycle import run_until_signalled
from echo.p2p.log_noise import quiet_libp2p
from echo.protocol.jobspec import SpecError

app = typer.Typer(
    help="Echo swarm volunteer node: lend this machine to RL training runs.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(stderr=True)


@app.callback()
def _main() -> None:
    """Echo swarm volunteer node."""


def _config(config: Path | None, **overrides):
    from echo.node.config import load_node_config

    try:
        return load_node_config(config, overrides)
    except SpecError as exc:
        console.print(f"[red]bad node settings:[/red]\n{exc}")
        raise typer.Exit(2) from None


@app.command()
def join(
    coordinator: Annotated[
        str | None,
        typer.Option(
            "--coordinator",
            "-C",
            help="the coordinator's multiaddr, as it prints on start "
            "(/ip4/HOST/tcp/PORT/p2p/PEER_ID)",
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="node.toml with any of these settings; flags win"),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="where the identity key, chunks and weights live (default: your user data dir)"
        ),
    ] = None,
    engine: Annotated[
        str | None, typer.Option(help="auto (pick from the hardware), torch, llamacpp or vllm")
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="torch engine device: auto, cpu, cuda, mps")
    ] = None,
    threads: Annotated[int | None, typer.Option(help="CPU threads the engine may use")] = None,
    max_tokens_per_s: Annotated[
        float | None,
        typer.Option(help="cap on generated tokens per second, to leave the machine responsive"),
    ] = None,
    schedule: Annotated[
        str | None, typer.Option(help="only work in these local hours, e.g. 22:00-07:00")
    ] = None,
    gpu_memory_fraction: Annotated[
        float | None, typer.Option(help="fraction of GPU memory the engine may take (vLLM)")
    ] = None,
    leases_at_once: Annotated[
        int | None, typer.Option(help="GRPO groups generated together in one batch")
    ] = None,
    max_upload_mbps: Annotated[
        float | None,
        typer.Option(
            help="cap on the upload spent relaying weights, MB/s (unset: none); behind a router "
            "without fair queueing, ~90% of your uplink avoids losses that stall transfers"
        ),
    ] = None,
    listen: Annotated[str | None, typer.Option(help="libp2p listen multiaddr")] = None,
    keep_weights: Annotated[
        bool | None,
        typer.Option(
            "--keep-weights/--no-keep-weights",
            help="write the policy the node holds to DATA_DIR/policy.safetensors",
        ),
    ] = None,
    cost: Annotated[
        float | None,
        typer.Option(
            help="what an hour of this machine costs, in the operator's units (default 1.0); "
            "the coordinator activates the cheapest nodes per unit of throughput first"
        ),
    ] = None,
    max_disk_gb: Annotated[
        float | None,
        typer.Option(
            help="disk the weights of jobs this node no longer serves may keep, GB (default 10)"
        ),
    ] = None,
    max_groups: Annotated[
        int | None,
        typer.Option(help="leave after this many groups (default: serve jobs until Ctrl-C)"),
    ] = None,
    api: Annotated[
        str | None,
        typer.Option(
            help="the coordinator's HTTP address (http://HOST:PORT): status and the local page "
            "then show this node's verified credit"
        ),
    ] = None,
    ui_port: Annotated[
        int | None,
        typer.Option(
            help="serve a status page on http://127.0.0.1:PORT/ (this machine only; 0: any free "
            "port, printed on start)"
        ),
    ] = None,
    nice: Annotated[
        int | None,
        typer.Option(
            help="CPU priority as nice, 0-19 (default 10): the machine's own work comes first; "
            "0 runs the node at normal priority"
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Join a swarm and serve its jobs until stopped: register, receive the policy, generate
    rollouts, submit them.

    The coordinator places the node on one job at a time and may move it; when a job ends the
    node switches to its next one without restarting (the last job's engine is closed), and with
    nothing to do it waits, shown as idle. The node's Ed25519 identity (also its libp2p peer id)
    is created on first run in the data dir with mode 0600 and reused afterwards. Stop any time
    with Ctrl-C; leases it held expire.
    """
    from echo.node.worker import Node, NodeError

    cfg = _config(
        config,
        coordinator=coordinator,
        data_dir=data_dir,
        engine=engine,
        device=device,
        threads=threads,
        max_tokens_per_s=max_tokens_per_s,
        max_upload_mbps=max_upload_mbps,
        schedule=schedule,
        gpu_memory_fraction=gpu_memory_fraction,
        leases_at_once=leases_at_once,
        listen=listen,
        keep_weights=keep_weights,
        cost=cost,
        max_disk_gb=max_disk_gb,
        api=api,
        ui_port=ui_port,
        nice=nice,
    )
    if not cfg.coordinator:
        console.print(
            "[red]no coordinator:[/red] pass --coordinator /ip4/.../p2p/... "
            "(the address echo-coordinator prints) or set it in node.toml"
        )
        raise typer.Exit(2)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    quiet_libp2p(logging.INFO if verbose else logging.ERROR, verbose=verbose)
    # Before any engine or trio thread starts: they inherit the lowered priority.
    lowered = yield_cpu(cfg.nice)
    logging.getLogger(__name__).info("nice %d: lowered %s", cfg.nice, lowered or "nothing")
    try:
        node = Node(cfg, console, max_groups=max_groups)
        if run_until_signalled(node.run):
            console.print("node stopped; leases it held will expire")
        else:
            console.print(f"node done: {node.done_groups} groups")
    except NodeError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    except ValueError as exc:  # engine choice, config values
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


@app.command()
def doctor(
    coordinator: Annotated[str | None, typer.Option("--coordinator", "-C")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c")] = None,
    data_dir: Annotated[Path | None, typer.Option()] = None,
) -> None:
    """Check everything a join needs; one line per check, with a fix for each problem."""
    from echo.node.doctor import run_doctor

    cfg = _config(config, coordinator=coordinator, data_dir=data_dir)
    ok = trio.run(run_doctor, cfg, console)
    raise typer.Exit(0 if ok else 1)


@app.command()
def identity(data_dir: Annotated[Path | None, typer.Option()] = None) -> None:
    """Print this node's peer id (created on first use)."""
    from echo.p2p.identity import Identity

    cfg = _config(None, data_dir=data_dir)
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    print(Identity.load_or_create(cfg.data_dir / "identity.key").peer_id_str)


@app.command()
def credit(
    api: Annotated[
        str,
        typer.Option(
            "--api",
            envvar="ECHO_COORDINATOR_API",
            help="the coordinator's HTTP address, e.g. http://HOST:8000",
        ),
    ],
    coordinator: Annotated[
        str | None,
        typer.Option("--coordinator", "-C", help="its multiaddr: the key entries must verify by"),
    ] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c")] = None,
    data_dir: Annotated[Path | None, typer.Option()] = None,
    node: Annotated[
        str | None, typer.Option(help="another node's peer id (default: this node's)")
    ] = None,
    last: Annotated[int, typer.Option(help="entries to list (the newest)")] = 10,
) -> None:
    """Show this node's credit from the coordinator's public ledger, every entry verified
    (signature, price, chain); works while the node is stopped."""
    from echo.node.credit_view import CreditViewError, fetch_ledger, show
    from echo.p2p.identity import Identity

    cfg = _config(config, coordinator=coordinator, data_dir=data_dir)
    if node is None:
        key = cfg.data_dir / "identity.key"
        if not key.exists():
            console.print(f"[red]no identity at {key}[/red]: pass --data-dir or --node")
            raise typer.Exit(2)
        node = Identity.load_or_create(key).peer_id_str
    try:
        got = fetch_ledger(api, node, cfg.coordinator)
    except CreditViewError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    show(Console(), node, got, max(0, last))


@app.command()
def status(
    coordinator: Annotated[
        str | None,
        typer.Option("--coordinator", "-C", help="its multiaddr: the key credit must verify by"),
    ] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c")] = None,
    data_dir: Annotated[Path | None, typer.Option()] = None,
    api: Annotated[
        str | None,
        typer.Option(
            "--api",
            envvar="ECHO_COORDINATOR_API",
            help="fetch and verify the credit now from the coordinator's HTTP address",
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the status file, and whether the node runs")
    ] = False,
) -> None:
    """Show what this node is doing, from another terminal or after it stopped: running or
    not (and why), engine, job and version held, tokens/s, groups accepted and rejected with
    the reasons and what to do, credit, the last problem. Exit status: 0 running, 3 not
    running, 2 no node has run with this data dir."""
    import json

    from echo.node.state import StatusFileError, read_status
    from echo.node.status_view import show_status

    cfg = _config(config, coordinator=coordinator, data_dir=data_dir, api=api)
    try:
        got = read_status(cfg.data_dir)
    except StatusFileError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps({**got.data, "running": got.running, "why": got.why}, indent=1))
        raise typer.Exit(0 if got.running else 3)
    credit = None
    if cfg.api:
        from echo.node.credit_view import CreditViewError, fetch_ledger
        from echo.protocol.credit import UCREDITS_PER_CREDIT

        try:
            d = got.data
            f = fetch_ledger(cfg.api, d["node_id"], cfg.coordinator or d["coordinator"])
            credit = {
                "credits": f.ledger.total / UCREDITS_PER_CREDIT,
                "entries": len(f.ledger.entries),
            }
        except CreditViewError as exc:
            credit = {"error": str(exc)}
    show_status(Console(), got, credit)
    raise typer.Exit(0 if got.running else 3)


service_app = typer.Typer(help="Run the node as a service that restarts after a crash or a reboot.")
app.add_typer(service_app, name="service")


@service_app.command("install")
def service_install(
    coordinator: Annotated[str | None, typer.Option("--coordinator", "-C")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c")] = None,
    data_dir: Annotated[Path | None, typer.Option()] = None,
    engine: Annotated[str | None, typer.Option()] = None,
    threads: Annotated[int | None, typer.Option()] = None,
    max_tokens_per_s: Annotated[float | None, typer.Option()] = None,
    schedule: Annotated[str | None, typer.Option()] = None,
    listen: Annotated[str | None, typer.Option()] = None,
    api: Annotated[str | None, typer.Option()] = None,
    ui_port: Annotated[int | None, typer.Option()] = None,
    print_only: Annotated[
        bool, typer.Option("--print", help="print the unit and the node.toml; write nothing")
    ] = False,
) -> None:
    """Write a systemd user unit that runs echo-node join with these settings (the --config
    file and flags, saved to DATA_DIR/node.toml) and restarts it when it fails; the node keeps
    its identity. Where systemd is absent, prints the unit instead."""
    from echo.node import service
    from echo.p2p.identity import Identity

    cfg = _config(
        config, coordinator=coordinator, data_dir=data_dir, engine=engine, threads=threads,
        max_tokens_per_s=max_tokens_per_s, schedule=schedule, listen=listen, api=api,
        ui_port=ui_port,
    )
    if not cfg.coordinator:
        console.print("[red]no coordinator:[/red] pass --coordinator or set it in node.toml")
        raise typer.Exit(2)
    cfg = cfg.model_copy(update={"data_dir": cfg.data_dir.resolve()})
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    node_id = Identity.load_or_create(cfg.data_dir / "identity.key").peer_id_str
    if print_only or not service.has_systemd():
        if not print_only:
            console.print("[yellow]systemd is not running here:[/yellow] the unit, to adapt:")
        path = cfg.data_dir / "node.toml"
        print(f"# {path}\n{service.config_toml(cfg)}")
        print(f"# {service.unit_dir() / service.UNIT_NAME}\n{service.unit_text(path, node_id)}")
        return
    config_path, unit_path = service.install(cfg, node_id)
    console.print(f"wrote {config_path} and {unit_path}; now run:")
    print("systemctl --user daemon-reload && systemctl --user enable --now echo-node")
    print("loginctl enable-linger $USER   # to start at boot, before you log in")
    print(f"echo-node status --config {config_path}   # what it does")
    print("journalctl --user -u echo-node  # its log")


if __name__ == "__main__":
    app()
