"""Discovery across real interfaces (issue 18): workers in their own network namespaces ("PCs") on one
bridge, found by zeroconf (real mDNS over the bridge, no --peer), a PC with two networks, cloned PCs,
a coordinator that hears no multicast, and requests with idle gaps longer than gRPC's keepalive.

One LAN for the module: PCs w0, w1, w2 serve stages 0..2 of the 3-stage build; ``dual`` serves stage 1
too, on a PC whose first interface is on a network the coordinator cannot reach; ``vpn`` likewise serves
stage 0 with ``--advertise-addr``; ``w2`` and ``clone`` serve stage 2 as cloned PCs would: one host
name (namespaces share it), the same port, and a bridge of their own at the same address (a VM network
cloned with the disk, ``virbr0`` at 10.0.0.1), so the same service name. Every worker announces itself;
the coordinator in ``coord`` finds them all by zeroconf; the one in ``quiet``, on another subnet behind
the router ``gw``, hears none of them."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from coordinator.tokenizer import ChatTokenizer
from tests.conftest import BIN
from tests.integration.reference import TransformersReference, near_ties

from .conftest import LanCoordinator, start_workers, stop_all

pytestmark = pytest.mark.lan

PROMPTS = ["What is the capital of France?"]  # one short answer: the reference costs ~20 s per 24 tokens here
NEW_TOKENS = 16
CLONE_PORT = 50731
KEEPALIVE_S = 10.0  # fleet_common.wire.GRPC_OPTIONS' grpc.keepalive_time_ms (not configurable)
# idle gaps longer than the keepalive between bursts of requests; FLEET_LAN_SOAK_REQUESTS=500 for the long run
SOAK_REQUESTS = int(os.environ.get("FLEET_LAN_SOAK_REQUESTS", "20"))  # two bursts, one gap
SOAK_BURST = 10


def _reference(build: Path, hf: Path) -> dict[str, tuple]:
    """Per prompt: transformers' greedy tokens in f32, their top-two gaps, and its teacher forcing."""
    tokenizer = ChatTokenizer(build)
    model = TransformersReference(hf)
    out = {}
    for p in PROMPTS:
        ids = tokenizer.encode_chat([{"role": "user", "content": p}])
        out[p] = (*model.greedy_with_margins(ids, NEW_TOKENS), functools.partial(model.forced_with_margins, ids))
    return out


@pytest.fixture(scope="module")
def reference_pending(build_3, demo_hf):  # noqa: ANN001, ANN201
    """The reference, computed on a thread while the LAN's workers start (it takes ~30 s here)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        yield pool.submit(_reference, build_3, demo_hf)


@pytest.fixture(scope="module")
def reference(reference_pending) -> dict[str, tuple]:  # noqa: ANN001
    return reference_pending.result()


@pytest.fixture(scope="module")
def office(reference_pending, lan, build_3, tmp_path_factory):  # noqa: ANN001, ANN201
    """The module's LAN, its workers (PC name -> LanWorker) and the log folder."""
    log_dir = tmp_path_factory.mktemp("lan-discovery")
    for pc in ("coord", "w0", "w1"):
        lan.add_pc(pc)
    lan.add_pc("quiet", net=3)
    for pc in ("w2", "clone"):
        lan.add_pc(pc, dummies={"virbr0": "10.0.0.1/24"})
    for pc, net in (("dual", 1), ("vpn", 2)):
        lan.add_pc(pc, net=net)  # eth0: a network only this PC is on (a VPN, a second subnet)
        lan.add_interface(pc, net=0)  # eth1: the LAN
    vpn_lan_address = lan.pcs["vpn"].interfaces["eth1"][0]
    workers = {}
    try:
        workers = start_workers(lan, build_3, log_dir, {
            "w0": 0, "w1": 1, "dual": 1, "vpn": (0, 0, "--advertise-addr", vpn_lan_address),
            "w2": (2, CLONE_PORT), "clone": (2, CLONE_PORT)})
        lan.add_router("gw", (0, 3))  # quiet's subnet: unicast is routed to the LAN, multicast is not
        for pc in ("dual", "vpn"):  # reachable from the coordinator only on eth1
            workers[pc].address = f"{lan.pcs[pc].interfaces['eth1'][0]}:{workers[pc].address.rsplit(':', 1)[1]}"
        yield lan, workers, log_dir
    finally:
        stop_all(workers.values())


@pytest.fixture(scope="module")
def coordinator(office, build_3):  # noqa: ANN001, ANN201
    """A coordinator in ``coord`` that finds every worker by zeroconf (no --peer), once all joined; its API
    is announced (for fleet-chat and ``fleet-coordinator status`` on the other PCs)."""
    lan, workers, log_dir = office
    coord = LanCoordinator(lan, "coord", build_3, log_dir, name="coordinator-mdns", announce=True)
    try:
        coord.wait_ready(timeout=240, workers=len(workers))  # the cloned PCs: one name, resolved one at a time
        yield coord
    finally:
        coord.stop()


def _joined(coord: LanCoordinator) -> dict[str, dict]:
    return {w["address"]: w for w in coord.health()["workers"] if w["healthy"]}


def test_three_pcs_found_by_zeroconf_answer_like_the_reference(office, coordinator, reference):
    _, workers, _ = office
    joined = _joined(coordinator)
    for pc in ("w0", "w1", "w2"):
        assert workers[pc].address in joined, (pc, workers[pc].address, joined)
        assert joined[workers[pc].address]["source"] == "mdns"
    ties = 0
    for prompt in PROMPTS:
        r = coordinator.chat(prompt, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert r.status_code == 200, r.text
        tokens, margins, forced = reference[prompt]
        ties += near_ties(r.json()["fleet"]["completion_token_ids"], tokens, margins, f"LAN on {prompt!r}", forced)
    assert ties <= 1


def test_another_pc_finds_the_coordinator_by_zeroconf_at_an_address_that_routes(office, coordinator):
    lan, _, _ = office
    url = f"http://{lan.pcs['coord'].address}:{coordinator.port}"
    status = subprocess.run(lan.pcs["w0"].cmd(str(BIN / "fleet-coordinator"), "status"), capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0 and url in status.stdout, status.stdout + status.stderr


def test_a_pc_with_two_networks_is_reached_on_the_one_that_routes(office, coordinator):
    _, workers, _ = office
    joined = _joined(coordinator)
    dual, vpn = workers["dual"], workers["vpn"]
    assert dual.address in joined and joined[dual.address]["stage"] == 1, (dual.address, joined)
    unreachable = f"{dual.lan.pcs['dual'].address}:{dual.address.rsplit(':', 1)[1]}"
    announced = re.search(r"announced (.*): reachable at " + re.escape(dual.address), coordinator.proc.text())
    assert announced and unreachable in announced.group(1), coordinator.proc.text()[-3000:]
    assert unreachable not in joined
    # --advertise-addr: only the address given is announced, and the coordinator dials it
    announced = re.search(r"announced \S+ on \[(.*)\]", vpn.proc.text()).group(1)
    assert announced == repr(vpn.address.rsplit(":", 1)[0]), announced
    assert vpn.address in joined and joined[vpn.address]["stage"] == 0, (vpn.address, joined)


def test_cloned_pcs_announcing_one_name_are_both_used(office, coordinator):
    _, workers, log_dir = office
    joined = _joined(coordinator)
    ids = set()
    for pc in ("w2", "clone"):
        assert workers[pc].address in joined, (pc, workers[pc].address, joined)
        ids.add(joined[workers[pc].address]["worker_id"])
    assert len(ids) == 2
    reported = [w.proc.text() for w in (workers["w2"], workers["clone"])] + [coordinator.proc.text()]
    assert any("is taken on the LAN" in t for t in reported[:2]) or "announce the same name" in reported[2] \
        or "two workers announce one name" in reported[2], "the name collision must be reported"
    assert len(joined) == len(workers), joined  # nothing else joined: no wrong address:port pair


def test_no_multicast_coordinator_uses_peers_and_says_nothing_was_heard(office, build_3):
    lan, workers, log_dir = office
    peers = [a for pc in ("w0", "w1", "w2") for a in ("--peer", workers[pc].address)]
    coord = LanCoordinator(lan, "quiet", build_3, log_dir, *peers, name="coordinator-quiet")
    try:
        coord.wait_ready(workers=3)
        assert coord.chat(PROMPTS[0], max_tokens=4).status_code == 200  # --peer across the router
        quiet = lan.pcs["quiet"].address
        coord.proc.wait_for(rf"no worker heard in \d+ s on eth0 {re.escape(quiet)}, lo 127.0.0.1; .*--peer", 30)
        assert re.search(rf"browsing zeroconf for workers .* on eth0 {re.escape(quiet)}, lo 127.0.0.1",
                         coord.proc.text())
    finally:
        coord.stop()


def test_requests_with_idle_gaps_longer_than_the_keepalive_never_stall(office, coordinator):
    """Bursts of requests (two at a time) through the 3-stage fleet across PCs, separated by idle gaps
    longer than gRPC's keepalive interval: every request is answered (or cleanly refused), none stalls."""
    lan, _, _ = office
    pool = lan.executor("coord")
    statuses: list[int] = []
    slowest = 0.0
    for burst in range(0, SOAK_REQUESTS, SOAK_BURST):
        if burst:
            time.sleep(KEEPALIVE_S + 2)
        def one(i: int) -> tuple[int, float]:  # noqa: E306
            start = time.monotonic()
            r = coordinator.chat(f"Count to {i % 7 + 2}.", max_tokens=4)
            assert r.status_code == 200 or (r.status_code in (429, 503) and r.json()["error"]["message"]), r.text
            return r.status_code, time.monotonic() - start
        futures = [pool.submit(one, i) for i in range(burst, min(burst + SOAK_BURST, SOAK_REQUESTS))]
        for f in futures:
            status, took = f.result(timeout=60)
            statuses.append(status)
            slowest = max(slowest, took)
    print(f"LAN keepalive: {len(statuses)} requests, {statuses.count(200)} answered, slowest {slowest:.2f} s")
    assert len(statuses) == SOAK_REQUESTS
    assert statuses.count(200) == SOAK_REQUESTS, statuses  # nothing else runs here: nothing to refuse
