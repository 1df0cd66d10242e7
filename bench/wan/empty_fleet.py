"""A fleet with nothing on the PCs (issue 30), timed: empty ``fleet-worker``s behind ``fleet-wan`` links, a
``fleet-coordinator serve --model SOURCE`` that plans over them, builds, ships each its stage and serves, then one
worker killed and the fleet re-planned over the rest.

Per source (the demo's Q4_1 GGUF, or a random GGUF of a real model's shape from ``bench/real_gguf.py``) and per
link (``loopback``: no link; ``1gbit``: ``fleet-wan``'s ``lan`` profile; ``100mbit``: the same at 100 Mbit/s),
every PC starts at once with an empty stage cache: the workers (each behind its own link, as a PC behind its own
NIC) and the coordinator, given the links' addresses by ``--peer``. Measured:

- ``first token s``: from the workers' start to the first content chunk of a streamed greedy request sent as soon
  as ``/health`` says 200, split into ``empty ready s`` (the worker measured its speed and serves Info), ``serving
  s`` (planned, built or taken from the build cache, shipped, loaded) and the request's TTFT;
- ``ship MB/s`` and ``% of link``: each stage's transfer as the coordinator logs it (sent bytes / time from
  ``StageStatus`` to the last piece written, hashed and renamed), against the link's rate;
- ``MB to PC`` against ``stage MB``: the bytes that crossed each PC's link (both ways, so the RPCs and the
  first answer too) against its stage's files in the manifest: a PC gets its stage only;
- ``worker peak MiB`` / ``coordinator peak MiB``: each process's peak RSS (VmHWM) once the first answer came;
- ``re-plan s``: one worker SIGKILLed, then the time until a greedy request answers again (the coordinator's
  own ``last_replan_s`` beside it), the MB the re-plan sent over each remaining PC's link and the MB each PC
  copied from the stage it held instead (ReuseStage).

A run builds its plan's stages unless the coordinator's ``--build-cache-dir`` (one per source, kept across the
links) holds that plan's build already (``build s``: the coordinator's own figure, in ``serving s``; ``-``: cached).
Every run's workers start empty and measure their speed again, so two runs may plan other splits. Workers run at
the build's default precision with ``--threads 1`` (two cores here).

    python bench/wan/empty_fleet.py [--source demo|llama-3.2-1b:Q4_K_M|PATH] [--links loopback,1gbit,100mbit]
                                [--workers 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import re
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from bench import clients, harness, models, real_gguf
from bench.wan.links import WanLink, profile
from fleet_common.manifest import load_manifest

LINKS = {"loopback": None, "1gbit": profile("lan"), "100mbit": profile("lan", rate_mbit=100)}
PROMPT = "Name three colours of the rainbow."
SHIPPED = re.compile(r"stage (\d+) shipped to (\S+): (\d+) bytes sent, (\d+) held already, ([\d.]+) s \(([\d.]+) MB/s")
REUSED = re.compile(r"stage \d+ shipped to (\S+): .*, (\d+) reused from the stages it holds")
BUILT = re.compile(r"coordinator.fleet.planned: built layers .* in ([\d.]+) s")
STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*"  # fleet's log line: asctime first


def stamp(log: str, pattern: str) -> float | None:
    """The wall-clock time (epoch s) of the first line of ``log`` matching ``pattern``, from its asctime."""
    if m := re.search(STAMP + pattern, log, re.MULTILINE):
        return datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def source_path(text: str) -> Path:
    """``demo`` (the demo's Q4_1 GGUF), ``NAME:TYPE`` of ``real_gguf.SHAPES`` (made once), or a GGUF file or HF
    folder (``models.resolve``). Raises ``models.ModelError`` for anything else (a build is not a source: its
    stages are fixed) and ``KeyError`` for an unknown NAME or TYPE."""
    if text == "demo":
        return harness.demo_gguf(harness.demo_hf())
    if ":" in text and not Path(text).exists():
        name, qtype = text.split(":", 1)
        return real_gguf.ensure(name, qtype)
    model = models.resolve(text)
    if model.kind == "build":
        raise models.ModelError(f"{text}: a fleet build, not a model source (a GGUF or an HF folder)")
    return model.path


def stage_bytes(build: Path) -> list[int]:
    """The bytes of each stage's files (those of the manifest under ``stage_N/``)."""
    m = load_manifest(build).manifest
    return [sum((build / f).stat().st_size for f in m.files if f.startswith(f"stage_{s}/"))
            for s in range(m.num_stages)]


def served_build(cache: Path, url: str) -> Path:
    """The build under ``cache`` (``--build-cache-dir``) that the coordinator at ``url`` serves (its /health
    ``manifest_sha256``): the cache holds the other runs' and re-plans' builds too."""
    sha = httpx.get(f"{url}/health", timeout=10).json()["manifest_sha256"]
    return next(m.parent for m in (cache / "builds").glob("*/manifest.json") if load_manifest(m.parent).sha256 == sha)


def first_token(url: str) -> float:
    """TTFT of a streamed greedy request, seconds."""
    with httpx.Client() as client:
        s = clients.stream_chat(client, url, [{"role": "user", "content": PROMPT}], 4, greedy=False,
                                extra={"temperature": 0}, timeout=600)
    return s.ttft_ms / 1000


def run(src: Path, link_name: str, workers: int, cache: Path, logs: Path) -> dict:
    """One cold start, then a re-plan, of ``src`` over ``workers`` empty workers behind ``link_name`` links."""
    from coordinator.fleet.local import free_port

    row: dict = {"source": src.name, "link": link_name}
    with ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="empty-fleet-"))
        stack.callback(shutil.rmtree, tmp, True)
        ports = [free_port() for _ in range(workers)]
        links = [WanLink(f"127.0.0.1:{p}", LINKS[link_name]).start() if LINKS[link_name] else None for p in ports]
        for link in links:
            if link is not None:
                stack.callback(link.stop)
        peers = [link.address if link else f"127.0.0.1:{p}" for link, p in zip(links, ports, strict=True)]
        t0, wall0 = time.monotonic(), time.time()
        procs = [harness.spawn([*harness.tool("fleet-worker"), "--port", str(p), "--no-announce", "--threads", "1",
                                "--stages-dir", str(tmp / f"stages{i}"), "--cache-dir", str(tmp / f"ov{i}")],
                               logs / f"{link_name}-worker{i}.log", stack) for i, p in enumerate(ports)]
        coordinator, url = harness.start_coordinator(src, logs / f"{link_name}-coordinator.log", "--draft", "none",
                                                     "--build-cache-dir", str(cache), stack=stack, peers=peers)
        harness.wait_ready(url, 3600, coordinator)
        serving = time.monotonic() - t0
        ttft = first_token(url)
        log = coordinator.text()
        sizes = stage_bytes(served_build(cache, url))
        shipped = {int(m[0]): (m[1], int(m[2]), float(m[4]), float(m[5])) for m in SHIPPED.findall(log)}
        peak = {peer: harness.proc_status(p.pid).get("VmHWM", 0) / (1 << 20)
                for peer, p in zip(peers, procs, strict=True)}
        crossed = {link.address: round(link.bytes / 1e6, 1) for link in links if link}  # the PC's link, both ways
        ready = [stamp(p.text(), "worker ready: empty") - wall0 for p in procs]
        row.update(empty_ready_s=round(max(ready), 1), serving_s=round(serving, 1), ttft_s=round(ttft, 2),
                   first_token_s=round(serving + ttft, 1),
                   coordinator_peak_mib=round(harness.proc_status(coordinator.pid).get("VmHWM", 0) / (1 << 20)),
                   build_s=float(m[1]) if (m := BUILT.search(log)) else None,
                   stages=[{"stage": s, "to": to, "sent_mb": round(sent / 1e6, 1), "ship_s": secs, "mb_per_s": rate,
                            "stage_mb": round(sizes[s] / 1e6, 1), "link_mb": crossed.get(to),
                            "worker_peak_mib": round(peak.get(to, 0))}
                           for s, (to, sent, secs, rate) in sorted(shipped.items())])
        row.update(replan(url, procs, links, peers, coordinator))
    return row


def replan(url: str, procs: list, links: list, peers: list[str], coordinator) -> dict:  # noqa: ANN001 - harness.Proc
    """Kill the last worker, time until a greedy request answers again; the re-plan's figures."""
    before = [link.bytes if link else 0 for link in links]
    logged = len(coordinator.text())
    t0 = time.monotonic()
    procs[-1].kill()
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health", timeout=10).json()
        if health.get("fleet", {}).get("replans", 0) >= 1 and health["ready"]:
            break
        time.sleep(0.5)
    else:
        raise TimeoutError(f"no re-plan after 1800 s:\n{coordinator.text()[-3000:]}")
    first_token(url)
    copied = {to: int(n) for to, n in REUSED.findall(coordinator.text()[logged:])}
    return {"replan_s": round(time.monotonic() - t0, 1), "coordinator_replan_s": health["fleet"]["last_replan_s"],
            "replan_copied_mb": [round(copied.get(peer, 0) / 1e6, 1) for peer in peers[:-1]],
            "replan_stages": health["num_stages"],
            "replan_link_mb": [round((link.bytes - b) / 1e6, 1) if link else None
                               for link, b in zip(links[:-1], before, strict=False)]}


def print_table(rows: list[dict]) -> None:
    """The runs as a markdown table, one line per run and stage."""
    out = []
    for r in rows:
        rate = LINKS[r["link"]].rate_mbit if LINKS[r["link"]] else None
        for s in r["stages"]:
            pct = f"{s['mb_per_s'] * 8 / rate * 100:.0f}%" if rate and s["mb_per_s"] else None
            out.append((r["source"], r["link"], s["stage"], r["empty_ready_s"], r["serving_s"], r["ttft_s"],
                        r["first_token_s"], r["build_s"], s["mb_per_s"], pct, s["link_mb"], s["stage_mb"],
                        s["worker_peak_mib"], r["coordinator_peak_mib"], r["replan_s"], r["coordinator_replan_s"],
                        " / ".join(str(x) for x in r["replan_link_mb"]), " / ".join(str(x) for x in r["replan_copied_mb"])))
    print(harness.table(("source", "link", "stage", "empty ready s", "serving s", "TTFT s", "first token s",
                         "build s", "ship MB/s", "% of link", "MB to PC", "stage MB", "worker peak MiB",
                         "coordinator peak MiB", "re-plan s",
                         "coordinator re-plan s", "re-plan MB to PCs", "re-plan MB copied on PCs"), out, pad=True))


def main(argv: list[str] | None = None) -> int:
    """Run every source over every link; print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", action="append", help="demo (default), NAME:TYPE of bench/real_gguf.py, "
                        "or a GGUF path; repeatable")
    parser.add_argument("--links", default="loopback,1gbit,100mbit",
                        help=f"comma-separated, of {', '.join(LINKS)} (default: all, in that order)")
    parser.add_argument("--workers", type=int, default=2, help="empty workers (default 2; one is killed)")
    parser.add_argument("--cache", type=Path, help="the coordinator's --build-cache-dir (default: a temporary "
                        "folder per source, so the first run builds)")
    parser.add_argument("--logs", type=Path, help="keep the processes' logs here")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    links = args.links.split(",")
    if unknown := [k for k in links if k not in LINKS]:
        parser.error(f"unknown link(s) {unknown}; known: {', '.join(LINKS)}")
    if args.workers < 2:
        parser.error("--workers must be >= 2 (one is killed for the re-plan)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="empty-fleet-") as scratch:
        logs = args.logs or Path(scratch) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for text in args.source or ["demo"]:
            try:
                src = source_path(text)
            except (models.ModelError, KeyError) as exc:  # resolve's message names --model: this is --source
                parser.error(f"--source {str(exc.args[0]).removeprefix('--model ')}")
            cache = args.cache or Path(scratch) / f"builds-{src.stem}"
            for link in links:
                print(f"{src.name} over {link} ...", flush=True)
                rows.append(run(src, link, args.workers, cache, logs))
    print_table(rows)
    harness.write_json(args.json, "empty_fleet", {"workers": args.workers, "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
