"""``echo-job``: submit and follow RL jobs through the coordinator's HTTP API."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="Submit and follow Echo swarm RL jobs (talks to echo-coordinator's HTTP API).",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()

UrlOpt = Annotated[
    str, typer.Option("--url", envvar="ECHO_COORDINATOR_URL", help="coordinator HTTP API base URL")
]
TokenOpt = Annotated[
    str,
    typer.Option(
        "--token",
        envvar="ECHO_API_TOKEN",
        help="bearer token (the coordinator's api_token, or its data_dir/api_token file)",
    ),
]


def _client(url: str, token: str) -> httpx.Client:
    if not token:
        console.print("[red]no API token:[/red] pass --token or set ECHO_API_TOKEN")
        raise typer.Exit(2)
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10.0)


def _call(url: str, token: str, method: str, path: str, **kw: Any) -> Any:
    try:
        with _client(url, token) as c:
            r = c.request(method, path, **kw)
    except httpx.HTTPError as exc:
        console.print(f"[red]cannot reach the coordinator at {url}:[/red] {exc}")
        raise typer.Exit(1) from None
    if r.status_code >= 400:
        try:
            msg = r.json().get("error", r.text)
        except ValueError:
            msg = r.text
        console.print(f"[red]error {r.status_code}:[/red] {msg}")
        raise typer.Exit(1)
    ctype = r.headers.get("content-type", "")
    return r.json() if ctype.startswith("application/json") else r.text


@app.command()
def submit(
    job_file: Annotated[
        Path, typer.Argument(help="job.toml with a [job] table", exists=True, dir_okay=False)
    ],
    url: UrlOpt = "http://127.0.0.1:8080",
    token: TokenOpt = "",
) -> None:
    """Submit a job; prints its id."""
    out = _call(
        url,
        token,
        "POST",
        "/v1/jobs",
        content=job_file.read_bytes(),
        headers={"content-type": "application/toml"},
    )
    console.print(out["job_id"])


@app.command("list")
def list_jobs(url: UrlOpt = "http://127.0.0.1:8080", token: TokenOpt = "") -> None:
    """List jobs: status, version, the nodes the scheduler placed on each, the rollouts/s the
    job needs to keep its learner busy (measured; "-" until it trained a version) against what
    its nodes deliver, and whether its learner is starved or saturated."""
    jobs = _call(url, token, "GET", "/v1/jobs")
    table = Table("job", "name", "status", "version", "nodes", "need/have rollouts/s", "learner")
    for j in jobs:
        rates = " / ".join(
            "-" if x is None else f"{x:.1f}"
            for x in (j.get("need_rollouts_per_s"), j.get("have_rollouts_per_s"))
        )
        busy = j.get("learner_busy")
        learner = j.get("learner", "-") + ("" if busy is None else f" (busy {busy:.0%})")
        table.add_row(
            j["job_id"],
            j["name"],
            j["status"],
            str(j["current_version"]),
            str(len(j.get("nodes", []))),
            rates,
            learner,
        )
    console.print(table)


@app.command()
def status(
    job_id: str,
    url: UrlOpt = "http://127.0.0.1:8080",
    token: TokenOpt = "",
    as_json: Annotated[bool, typer.Option("--json", help="print the raw JSON")] = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="refresh every 2 s")] = False,
) -> None:
    """Show a job: versions, reward per version, rollouts accepted/rejected."""
    while True:
        st = _call(url, token, "GET", f"/v1/jobs/{job_id}")
        if as_json:
            console.print_json(json.dumps(st))
        else:
            _print_status(st)
        if not watch or st["status"] in ("done", "failed", "cancelled"):
            return
        time.sleep(2.0)


def _print_status(st: dict[str, Any]) -> None:
    c = st["rollouts"]
    # Absent from a coordinator older than the per-job breakdown.
    reasons = ", ".join(f"{k} {v}" for k, v in st.get("rejected_by_reason", {}).items())
    console.print(
        f"[bold]{st['job_id']}[/bold] {st['status']}  v{st['current_version']}"
        f"/{st['steps']}  trained {c.get('trained', 0)}  buffered "
        f"{c.get('accepted', 0)}  rejected {c.get('rejected_total', 0)}"
        + (f" ({reasons})" if reasons else "")
        + (f"  set aside (no advantage) {c['uniform']}" if c.get("uniform") else "")
    )
    if st["error"]:
        console.print(f"[red]{st['error']}[/red]")
    ln = st.get("learning") or {}
    if ln.get("versions"):

        def fmt(key: str, spec: str) -> str:
            return "-" if ln.get(key) is None else format(ln[key], spec)

        console.print(
            f"last {ln['versions']} versions: groups {fmt('staleness_mean', '.2f')} versions "
            f"old on average (max {fmt('staleness_max', '.0f')}); importance weight pi/mu mean "
            f"{fmt('is_w_mean', '.3f')}, {fmt('is_w_outside_trust_region', '.1%')} of tokens "
            f"outside the trust region"
        )
    if ln.get("eval_last") is not None:
        console.print(f"held-out greedy accuracy: {ln['eval_first']:.3f} -> {ln['eval_last']:.3f}")
    curve = st["reward_by_version"]
    if curve:
        pts = curve if len(curve) <= 12 else curve[:: max(1, len(curve) // 12)] + [curve[-1]]
        console.print(
            "reward by version: "
            + "  ".join(f"v{p['version']}:{p['mean_reward']:.2f}" for p in pts)
        )


@app.command()
def plan(job_id: str, url: UrlOpt = "http://127.0.0.1:8080", token: TokenOpt = "") -> None:
    """The capacity model with the terms measured so far: will the learner wait for rollouts?"""
    p = _call(url, token, "GET", f"/v1/jobs/{job_id}/plan")
    console.print(
        f"R = {p['R']} rollouts per update, T_train = {p['T_train_s']:.3f} s, "
        f"T_bcast = {p['T_bcast_s']:.3f} s, kappa = {p['kappa']}"
    )
    need = p["required_rollouts_per_s"]
    need_s = "unreachable" if need is None else f"{need:.1f} rollouts/s"
    console.print(
        f"required: {need_s}   available: "
        f"{p['available_rollouts_per_s']:.1f} rollouts/s "
        f"({p['tokens_per_rollout']:.1f} tokens per rollout)"
    )
    verdict = "[green]feasible[/green]" if p["feasible"] else "[red]not feasible[/red]"
    console.print(f"{verdict}: {p['note']}")
    console.print(f"active: {len(p['active'])} node(s); standby: {len(p['standby'])}")
    console.print(
        f"staleness: this job runs S = {p['staleness']}; recommended "
        f"S = {p['recommended_staleness']}: {p['recommendation']}"
    )
    for o in p["staleness_options"]:
        period = "-" if o["period_s"] is None else f"{o['period_s']:.2f} s"
        console.print(
            f"  S = {o['staleness']}: a version every {period}, learner busy "
            f"{o['learner_busy']:.0%}, {o['speedup_vs_sync']:.2f}x S = 0"
        )
    if not _print_learner_memory(p.get("learner_memory")):
        raise typer.Exit(1)


def _print_learner_memory(mem: dict[str, Any] | None) -> bool:
    """The learner's per-rank memory (echo.learner.memory); False when it does not fit."""
    if mem is None:
        return True
    if "error" in mem:
        console.print(f"learner memory: not estimated ({mem['error']})")
        return True

    def gb(key: str) -> str:
        n = mem[key]
        return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"

    console.print(
        f"learner: {mem['backend']}, {mem['ranks']} rank(s) on {mem['device']}, compute in "
        f"{mem['compute_dtype']}; {mem['params']:,} parameters, {mem['trained_params']:,} trained"
    )
    console.print(
        f"  per rank: weights {gb('weights_bytes')}, gradients {gb('grads_bytes')}, AdamW "
        f"{gb('optim_bytes')}, KL reference {gb('reference_bytes')}, re-scorer "
        f"{gb('rescorer_bytes')}, gathered layers {gb('gathered_bytes')}, activations "
        f"{gb('activations_bytes')} ({mem['tokens_per_rank']:,} tokens)"
    )
    have = mem["available_per_rank_bytes"]
    have_s = f"{have / 1e9:.2f} GB" if have else "unknown"
    console.print(
        f"  total {gb('total_bytes')} per rank ({gb('leader_total_bytes')} on rank 0), the "
        f"device offers {have_s}; host memory while building {gb('build_host_bytes')} per rank"
    )
    if not mem["fits"]:
        console.print(f"[red]the learner does not fit:[/red] {mem['misfit']}")
    return bool(mem["fits"])


@app.command()
def logs(
    job_id: str, url: UrlOpt = "http://127.0.0.1:8080", token: TokenOpt = "", lines: int = 100
) -> None:
    """Print the tail of the job's learner log."""
    console.print(
        _call(url, token, "GET", f"/v1/jobs/{job_id}/logs", params={"lines": lines}),
        end="",
        markup=False,
        highlight=False,
    )


@app.command()
def cancel(job_id: str, url: UrlOpt = "http://127.0.0.1:8080", token: TokenOpt = "") -> None:
    """Cancel a job: its learner stops and no more leases are issued."""
    out = _call(url, token, "POST", f"/v1/jobs/{job_id}/cancel")
    console.print("cancelled" if out["cancelled"] else "job was not running")


@app.command("learner-epoch")
def learner_epoch(
    job_id: str, url: UrlOpt = "http://127.0.0.1:8080", token: TokenOpt = ""
) -> None:
    """Hand the job to a learner you run yourself: print a new learner epoch for it, to pass
    as `python -m echo.learner ... --epoch N`. Every learner of the job started before (the
    coordinator's own included) is refused from then on."""
    out = _call(url, token, "POST", f"/v1/jobs/{job_id}/learner-epoch")
    console.print(out["epoch"], markup=False, highlight=False)


# Writing a large model's export on the coordinator takes minutes; the POST waits for it.
EXPORT_TIMEOUT = httpx.Timeout(10.0, read=3600.0)


@app.command()
def export(
    job_id: str,
    out_dir: Annotated[Path, typer.Argument(help="new or empty folder to write the model into")],
    version: Annotated[
        int | None, typer.Option("--version", "-v", help="version to export (default: newest)")
    ] = None,
    merged: Annotated[
        bool,
        typer.Option("--merged", help="a LoRA job: the adapter merged into its base model"),
    ] = False,
    url: UrlOpt = "http://127.0.0.1:8080",
    token: TokenOpt = "",
) -> None:
    """Download a published version as a Hugging Face model folder (safetensors, config,
    tokenizer and chat template): AutoModelForCausalLM.from_pretrained(OUT_DIR) loads it. A
    LoRA job's version is a peft adapter folder (PeftModel.from_pretrained on the job's base),
    or with --merged a full model folder with the adapter merged in."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        console.print(f"[red]{out_dir} is not an empty folder:[/red] choose a new or empty one")
        raise typer.Exit(2)
    params: dict[str, Any] = {} if version is None else {"version": version}
    if merged:
        params["merged"] = 1
    with console.status("the coordinator is writing the export..."):
        listing = _call(
            url, token, "POST", f"/v1/jobs/{job_id}/export", params=params, timeout=EXPORT_TIMEOUT
        )
    v = listing["version"]
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        _download(url, token, f"/v1/jobs/{job_id}/export/{v}", listing["files"], out_dir,
                  {"merged": 1} if merged else {})  # fmt: skip
    except _DownloadError as exc:
        console.print(f"[red]export download failed:[/red] {exc}")
        raise typer.Exit(1) from None
    console.print(f"{job_id} v{v} -> {out_dir} ({len(listing['files'])} files)")


class _DownloadError(Exception):
    pass


def _download(
    url: str,
    token: str,
    base: str,
    files: list[dict[str, Any]],
    out: Path,
    params: dict[str, Any] | None = None,
) -> None:
    """Fetch every listed file into ``out``, checking its size and sha256 as it streams; a file
    is renamed into place only once it checks out. :raises _DownloadError: what went wrong."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    total = sum(int(f["size"]) for f in files)
    with (
        _client(url, token) as c,
        Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=console,
        ) as bar,
    ):
        task = bar.add_task("export", total=total)
        for f in files:
            name, size = str(f["name"]), int(f["size"])
            if "/" in name or name.startswith("."):
                raise _DownloadError(f"the coordinator listed a bad file name {name!r}")
            part = out / f".{name}.part"
            h = hashlib.sha256()
            got = 0
            try:
                with c.stream(
                    "GET", f"{base}/{name}", params=params or {}, timeout=EXPORT_TIMEOUT
                ) as r:
                    if r.status_code >= 400:
                        raise _DownloadError(f"{name}: HTTP {r.status_code}")
                    with part.open("wb") as fh:
                        for block in r.iter_bytes(1 << 20):
                            got += len(block)
                            if got > size:
                                raise _DownloadError(f"{name}: more than the {size} bytes listed")
                            h.update(block)
                            fh.write(block)
                            bar.advance(task, len(block))
            except httpx.HTTPError as exc:
                raise _DownloadError(f"{name}: {exc}") from None
            if got != size or h.hexdigest() != f["sha256"]:
                part.unlink(missing_ok=True)
                raise _DownloadError(f"{name}: size or sha256 differs from the listing")
            part.replace(out / name)


def token_from_dir(data_dir: Path) -> str:
    """The API token a coordinator keeps in ``data_dir``, else ``$ECHO_API_TOKEN``, else ""."""
    p = data_dir / "api_token"
    return p.read_text().strip() if p.exists() else os.environ.get("ECHO_API_TOKEN", "")


if __name__ == "__main__":
    app()
