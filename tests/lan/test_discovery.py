"""Discovery across real interfaces (issue 18): workers in their own network namespaces ("PCs") on one
bridge, found by zeroconf (real mDNS over the bridge, no --peer), a PC with two networks, cloned PCs,
and a coordinator that hears no multicast.

One LAN for the module: PCs w0, w1, w2 serve stages 0..2 of the 3-stage build; ``dual`` serves stage 1
too, on a PC whose first interface is on a network the coordinator cannot reach; ``vpn`` likewise serves
stage 0 with ``--advertise-addr``; ``w2`` and ``clone`` serve stage 2 as cloned PCs would: one host
name (namespaces share it), the same port, and a bridge of their own at the same address (a VM network
cloned with the disk, ``virbr0`` at 10.0.0.1), so the same service name. Every PC's worker announces itself; the coordinator in ``coord`` finds them all by zeroconf; the
one in ``quiet``, on another subnet behind the router ``gw``, hears none of them."""

from __future__ import annotations

import functools
import re

import pytest

from coordinator.tokenizer import ChatTokenizer
from tests.integration.reference import TransformersReference, near_ties

from .conftest import LanCoordinator, start_workers, stop_all

PROMPTS = ["What is the capital of France?"]  # one short answer: the reference costs ~20 s per 24 tokens here
NEW_TOKENS = 16
CLONE_PORT = 50731


@pytest.fixture(scope="module")
def reference(build_3, demo_hf) -> dict[str, tuple]:
    tokenizer = ChatTokenizer(build_3)
    model = TransformersReference(demo_hf)
    out = {}
    for p in PROMPTS:
        ids = tokenizer.encode_chat([{"role": "user", "content": p}])
        out[p] = (*model.greedy_with_margins(ids, NEW_TOKENS), functools.partial(model.forced_with_margins, ids))
    return out


@pytest.fixture(scope="module")
def office(lan, build_3, tmp_path_factory):  # noqa: ANN001, ANN201
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
    """A coordinator in ``coord`` that finds every worker by zeroconf (no --peer), once all joined."""
    lan, workers, log_dir = office
    coord = LanCoordinator(lan, "coord", build_3, log_dir, name="coordinator-mdns")
    try:
        coord.wait_ready(workers=len(workers))
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
    assert any("is taken on the LAN" in t for t in reported[:2]) or "announce the same name" in reported[2], \
        "the name collision must be reported"
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
