"""``echo-coordinator``: the operator's daemon."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import trio
import typer
from rich.console import Console

from echo.p2p.lifecycle import run_until_signalled
from echo.p2p.log_noise import quiet_libp2p
from echo.protocol.jobspec import SpecError

app = typer.Typer(
    help="Echo swarm coordinator: jobs, dispatch, verification, learner, HTTP API.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(stderr=True)


@app.callback()
def _main() -> None:
    """Echo swarm coordinator."""


@app.command()
def serve(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", help="coordinator.toml; defaults apply for anything it leaves out"
        ),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(help="where the database, job folders and keys live (overrides the config)"),
    ] = None,
    listen: Annotated[
        list[str] | None,
        typer.Option(help="libp2p listen multiaddr, repeatable (overrides the config)"),
    ] = None,
    http_port: Annotated[int | None, typer.Option(help="HTTP API port (0 = any free port)")] = None,
    dataset_root: Annotated[
        list[Path] | None,
        typer.Option(
            help="a folder jobs may read dataset files from, repeatable (overrides the "
            "config's [jobs] dataset_roots; default: <data dir>/datasets)"
        ),
    ] = None,
    info_file: Annotated[
        Path | None,
        typer.Option(
            help="write the multiaddr, HTTP URL and API token as JSON here once listening "
            "(mode 0600: it holds the token)"
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False,
) -> None:
    """Run the coordinator daemon until Ctrl-C.

    It listens for nodes and learners on libp2p (TCP, Noise, yamux), serves the job API over HTTP,
    and starts a learner subprocess for each job. State lives in SQLite under the data dir; a
    restart resumes every running job where it was.
    """
    from echo.coordinator.config import load_config, write_private
    from echo.coordinator.service import Coordinator
    from echo.coordinator.store import Store
    from echo.p2p.identity import Identity

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    quiet_libp2p(logging.WARNING, verbose=verbose)
    logging.getLogger("hypercorn").setLevel(logging.WARNING)
    try:
        cfg = load_config(config)
    except SpecError as exc:
        console.print(f"[red]bad configuration:[/red]\n{exc}")
        raise typer.Exit(2) from None
    updates = {}
    if data_dir is not None:
        updates["data_dir"] = data_dir
    if listen:
        updates["listen"] = listen
    if http_port is not None:
        updates["http_port"] = http_port
    if dataset_root:
        updates["jobs"] = cfg.jobs.model_copy(update={"dataset_roots": dataset_root})
    cfg = cfg.model_copy(update=updates)
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    store = Store.open(cfg.data_dir / "coordinator.sqlite")
    identity = Identity.load_or_create(cfg.data_dir / "coordinator.key")
    coord = Coordinator(cfg, store, identity)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(coord.run)
            console.print(f"[bold green]coordinator up[/bold green] peer {coord.identity.peer_id}")
            for addr in coord.multiaddrs:
                console.print(f"  libp2p  {addr}")
            for url in coord.http_addrs:
                console.print(f"  http    {url}   (token in {cfg.data_dir / 'api_token'})")
            console.print(
                f"  join with: [bold]echo-node join --coordinator {coord.multiaddrs[0]}[/bold]"
            )
            if info_file is not None:  # it holds the API token: this user's eyes only
                write_private(
                    info_file,
                    json.dumps(
                        {
                            "multiaddrs": coord.multiaddrs,
                            "http": coord.http_addrs,
                            "token": coord.token,
                            "peer_id": str(coord.identity.peer_id),
                        }
                    ),
                )

    try:
        run_until_signalled(main)
        console.print("coordinator stopped")
    finally:
        store.close()


if __name__ == "__main__":
    app()
