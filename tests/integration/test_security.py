"""Security on a real fleet (real processes, real gRPC on loopback): HMAC tokens with --secret,
mutual TLS with certificates made here, HTTP API keys, and --local-workers passing them on.

Every worker runs with --no-announce and every coordinator with --no-discover --peer: other tests on
this machine must not find these workers, nor these coordinators theirs. The one coordinator announced
(for fleet-chat's discovery) serves a model name made up per run, which no other coordinator announces."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import uuid

import grpc
import httpx
import pytest
from google.protobuf.message import Message

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.security import make_token
from tests.conftest import BIN, chat, start_coordinator, start_worker, wait_ready

pytestmark = pytest.mark.integration

SECRET = "fleet test secret 8b1f0c"
KEYS = ("alice-key-3f9a", "bob-key-77c2")
QUESTION = "What is the capital of France?"


def call(stub_method, request, method: str, secret: str | None):  # noqa: ANN001, ANN201
    """One call of ``/fleet.v1.Stage/<method>``, with a token made from ``secret`` (none when None)."""
    metadata = [("authorization", make_token(secret.encode(), f"/fleet.v1.Stage/{method}"))] if secret else None
    return stub_method(request, timeout=10, metadata=metadata)


def refused(fn) -> tuple[grpc.StatusCode, str]:  # noqa: ANN001
    """The status and details of the error ``fn()`` raises (a returned stream is read to its end)."""
    with pytest.raises(grpc.RpcError) as info:
        result = fn()
        if not isinstance(result, Message):
            list(result)
    return info.value.code(), info.value.details()


def peers(*addresses: str) -> list[str]:
    return ["--no-discover", *(a for address in addresses for a in ("--peer", address))]


def answer(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def secret_fleet(build_2, tmp_path_factory):
    """Two workers and a coordinator sharing a secret; the coordinator also requires API keys."""
    d = tmp_path_factory.mktemp("secret-fleet")
    (d / "secret").write_text(f"  {SECRET}\n")  # stripped
    (d / "keys").write_text(f"# fleet API keys\n{KEYS[0]}\n\n{KEYS[1]}  # Bob\n")
    procs, addresses = [], []
    try:
        for shard in range(2):
            proc, address = start_worker(build_2, shard, d, "--no-announce", "--secret", str(d / "secret"))
            procs.append(proc)
            addresses.append(address)
        coordinator, url = start_coordinator(build_2, d, "--secret", str(d / "secret"), "--api-key-file",
                                             str(d / "keys"), *peers(*addresses))
        procs.append(coordinator)
        wait_ready(url)
        yield {"dir": d, "url": url, "workers": addresses, "procs": procs}
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_worker_refuses_calls_without_the_right_token(secret_fleet):
    address = secret_fleet["workers"][1]
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.StageStub(channel)
        before = call(stub.Info, pb.InfoRequest(), "Info", SECRET)
        open_request = pb.OpenSessionRequest(session_id="intruder", max_context=64)
        for secret in (None, "not the fleet's secret"):
            code, details = refused(lambda: call(stub.OpenSession, open_request, "OpenSession", secret))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert ("carried none" if secret is None else "differs") in details
            for method, request in (("Info", pb.InfoRequest()),
                                    ("CloseSession", pb.CloseSessionRequest(session_id="x")),
                                    ("Forward", pb.ForwardRequest(session_id="intruder", stage=1)),
                                    ("Subscribe", pb.SubscribeRequest(subscriber_id="eavesdropper"))):
                code, _ = refused(lambda: call(getattr(stub, method), request, method, secret))
                assert code == grpc.StatusCode.UNAUTHENTICATED, method
        # a token for another method is no good either
        stolen = [("authorization", make_token(SECRET.encode(), "/fleet.v1.Stage/Info"))]
        code, _ = refused(lambda: stub.OpenSession(open_request, timeout=10, metadata=stolen))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        after = call(stub.Info, pb.InfoRequest(), "Info", SECRET)
        assert (after.sessions, after.kv_reserved_bytes) == (before.sessions, before.kv_reserved_bytes) == (0, 0)
        # the right token opens and closes a session
        call(stub.OpenSession, open_request, "OpenSession", SECRET)
        assert call(stub.Info, pb.InfoRequest(), "Info", SECRET).sessions == 1
        assert call(stub.CloseSession, pb.CloseSessionRequest(session_id="intruder"), "CloseSession", SECRET).existed
    worker_log = secret_fleet["procs"][1]
    worker_log.wait_for(r"refused /fleet\.v1\.Stage/OpenSession: this worker requires a fleet token", timeout=5)


def keyed_chat(url: str, key: str | None, content: str = QUESTION, **kw) -> httpx.Response:
    """``chat`` with ``Authorization: Bearer key`` (no header when ``key`` is None)."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, **kw}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_fleet_with_a_secret_answers(secret_fleet):
    assert "Paris" in answer(keyed_chat(secret_fleet["url"], KEYS[1], max_tokens=16))


def test_api_keys(secret_fleet):
    url = secret_fleet["url"]
    refusals = [keyed_chat(url, None, max_tokens=4), keyed_chat(url, "wrong-key", max_tokens=4),
                httpx.get(f"{url}/v1/models", timeout=10),
                httpx.get(f"{url}/v1/models", headers={"Authorization": KEYS[0]}, timeout=10),  # no "Bearer"
                httpx.post(f"{url}/v1/chat/completions", content=b"not json", timeout=10)]  # refused before parsing
    for r in refusals:
        assert r.status_code == 401, r.text
        assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                      "param": None, "code": "invalid_api_key"}}
    assert "requires an API key" in refusals[0].json()["error"]["message"]
    assert refusals[1].json()["error"]["message"] == "invalid API key"
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=10)
    assert r.status_code == 200 and r.json()["data"][0]["id"]
    health = httpx.get(f"{url}/health", timeout=10)  # open (load balancers), but names no worker without a key
    assert health.status_code == 200 and health.json()["ready"] and "workers" not in health.json()
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401  # its labels name every worker
    assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=10).status_code == 200

    def fleet_chat(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        environ = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "FLEET_API_KEY")}
        return subprocess.run([str(BIN / "fleet-chat"), "--url", url, "--max-tokens", "16", "-p", QUESTION, *args],
                              capture_output=True, text=True, timeout=120, env={**environ, **(env or {})})

    done = fleet_chat("--api-key", KEYS[0])
    assert done.returncode == 0 and "Paris" in done.stdout, done.stderr
    done = fleet_chat(env={"FLEET_API_KEY": KEYS[1]})
    assert done.returncode == 0 and "Paris" in done.stdout, done.stderr
    done = fleet_chat()
    assert done.returncode == 2 and "refused the API key" in done.stderr, done.stderr


def test_coordinator_with_another_secret_cannot_use_the_workers(secret_fleet, build_2, tmp_path):
    (tmp_path / "secret").write_text("some other fleet's secret\n")
    coordinator, url = start_coordinator(build_2, tmp_path, "--secret", str(tmp_path / "secret"),
                                         "--health-interval-s", "0.3", *peers(*secret_fleet["workers"]))
    try:
        for address in secret_fleet["workers"]:
            coordinator.wait_for(rf"worker {address} refused this caller's credentials: wrong fleet token", timeout=10)
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["missing_stages"] == [0, 1]
        r = chat(url, QUESTION, max_tokens=4)
        assert r.status_code == 503, r.text
    finally:
        coordinator.stop()


def _certificates(d) -> dict[str, str]:  # noqa: ANN001
    """A CA, and certificates for 127.0.0.1 signed by it (worker, coordinator), plus one from another CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    files = {}

    def write(name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> None:
        (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[name] = str(d / f"{name}.pem")
        if key is not None:
            (d / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                              serialization.PrivateFormat.PKCS8,
                                                              serialization.NoEncryption()))
            files[f"{name}-key"] = str(d / f"{name}.key")

    def ca(name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, encipher_only=False, decipher_only=False),
                               critical=True)
                .sign(key, hashes.SHA256()))
        return cert, key

    def leaf(name: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey]) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(issuer[0].subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                               critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(issuer[1], hashes.SHA256()))
        write(name, cert, key)

    fleet_ca, stranger_ca = ca("fleet test CA"), ca("some other CA")
    write("ca", fleet_ca[0])
    leaf("coordinator", fleet_ca)
    leaf("stranger", stranger_ca)
    return files


def test_mutual_tls_fleet_with_local_workers(build_2, tmp_path):
    """``--local-workers 2`` with mutual TLS and a secret: the children get both, talk TLS to each other
    and answer; plaintext, certificate-less and foreign-certificate clients are refused."""
    pem = _certificates(tmp_path)
    (tmp_path / "secret").write_text(SECRET)
    tls = ["--tls-cert", pem["coordinator"], "--tls-key", pem["coordinator-key"], "--tls-ca", pem["ca"]]
    coordinator, url = start_coordinator(build_2, tmp_path, "--local-workers", "2", "--worker-threads", "1",
                                         "--inference-precision", "f32",  # the answer below, not a bf16 near-tie
                                         "--secret", str(tmp_path / "secret"), *tls, "--no-discover")
    try:
        wait_ready(url)
        assert "Paris" in answer(chat(url, QUESTION, max_tokens=16))
        text = coordinator.text()
        assert text.count("HMAC tokens, mutual TLS, serving on 127.0.0.1:") == 2  # both children
        assert "links to workers: HMAC tokens, mutual TLS" in text
        address = httpx.get(f"{url}/health", timeout=5).json()["workers"][0]["address"]

        def info(credentials: grpc.ChannelCredentials | None, secret: str | None = SECRET):  # noqa: ANN202
            channel = (grpc.insecure_channel(address) if credentials is None
                       else grpc.secure_channel(address, credentials))
            with channel:
                return call(pb_grpc.StageStub(channel).Info, pb.InfoRequest(), "Info", secret)

        ca = open(pem["ca"], "rb").read()

        def creds(name: str) -> grpc.ChannelCredentials:
            return grpc.ssl_channel_credentials(ca, open(pem[f"{name}-key"], "rb").read(), open(pem[name], "rb").read())

        assert info(creds("coordinator")).stage in (0, 1)  # what the coordinator does
        assert refused(lambda: info(None))[0] == grpc.StatusCode.UNAVAILABLE  # plaintext
        assert refused(lambda: info(grpc.ssl_channel_credentials(ca)))[0] == grpc.StatusCode.UNAVAILABLE  # no cert
        assert refused(lambda: info(creds("stranger")))[0] == grpc.StatusCode.UNAVAILABLE  # another CA's cert
        assert refused(lambda: info(creds("coordinator"), secret=None))[0] == grpc.StatusCode.UNAUTHENTICATED
    finally:
        coordinator.stop()


def test_openai_api_key_is_sent_only_with_url(build_2, tmp_path):
    """$OPENAI_API_KEY (a key for another service) never goes to a coordinator fleet-chat found by zeroconf,
    which anyone on the LAN can announce; with ``--url`` it does, and $FLEET_API_KEY goes to either. The
    coordinator requires that very key, so its refusal says whether an Authorization header arrived ("requires
    an API key": none; a header with the key would have been accepted). It needs no workers for /v1/models."""
    key, name = "openai-key-5d2e", f"key-leak-test-{uuid.uuid4().hex[:8]}"  # a name no other coordinator announces
    (tmp_path / "keys").write_text(f"{key}\n")
    coordinator, url = start_coordinator(build_2, tmp_path, "--no-discover", "--api-key-file", str(tmp_path / "keys"),
                                         "--served-model-name", name, announce=True)
    environ = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "FLEET_API_KEY")}

    def fleet_chat(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "fleet-chat"), "--max-tokens", "4", "-p", "hi", *args], capture_output=True,
                              text=True, timeout=60, env={**environ, **env})

    try:
        found = fleet_chat("--model", name, OPENAI_API_KEY=key)
        assert found.returncode == 2, found.stdout + found.stderr
        assert f"{url} refused the API key: this fleet requires an API key" in found.stderr, found.stderr
        given = fleet_chat("--url", url, OPENAI_API_KEY=key)  # the same key, same coordinator: accepted
        assert f"connected to {url} ({name})" in given.stderr, given.stderr
        assert given.returncode == 1 and "no healthy worker serves stages 0, 1" in given.stderr, given.stderr
        fleet_key = fleet_chat("--model", name, FLEET_API_KEY=key)  # discovery itself passes a fleet key on
        assert f"connected to {url} ({name})" in fleet_key.stderr, fleet_key.stderr
    finally:
        coordinator.stop()


def test_worker_on_a_non_loopback_address_without_a_secret_warns(build_2, tmp_path):
    """``--host 0.0.0.0`` (every interface; nothing here dials anything but loopback) without ``--secret``
    logs the loud warning; with a secret it does not."""
    (tmp_path / "secret").write_text(SECRET)
    open_worker, address = start_worker(build_2, 1, tmp_path, "--no-announce", "--host", "0.0.0.0")
    try:
        assert address.startswith("0.0.0.0:"), address
        port = address.rsplit(":", 1)[1]
        warning = (f"WARNING worker[1] worker.cli: !!! worker bound to 0.0.0.0 WITHOUT --secret: anyone who can "
                   f"reach port {port} can run sessions on it")
        assert warning in open_worker.text(), open_worker.text()
    finally:
        open_worker.stop()
    keyed, _ = start_worker(build_2, 1, tmp_path, "--no-announce", "--host", "0.0.0.0", "--secret",
                            str(tmp_path / "secret"), name="-keyed")
    keyed.stop()
    assert "HMAC tokens" in keyed.text() and "WITHOUT --secret" not in keyed.text(), keyed.text()
