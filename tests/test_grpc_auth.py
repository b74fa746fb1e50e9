"""API keys and TLS on the gRPC server, in-process: every method of both services needs a key
(health and reflection do not), both keys work, the Python clients send theirs (or
FASTGEN_API_KEY's), and a TLS server serves clients that verify its self-signed certificate."""

import asyncio
import shutil
import subprocess

import grpc
import pytest
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from fastgen import EngineConfig
from fastgen.engine import Engine
from fastgen.engine import EngineLoop
from fastgen.serving.backend import LocalBackend
from fastgen.serving.client import AsyncClient, Client, client
from fastgen.serving.grpc.server import MII_SERVICE, TYPED_SERVICE, GrpcServer
from fastgen.serving.limits import API_KEY_ENV, ServingLimits
from fastgen.serving.grpc.proto import fastgen_v1_pb2 as pb
from fastgen.serving.grpc.proto import fastgen_v1_pb2_grpc as pb_grpc
from fastgen.serving.grpc.proto import modelresponse_pb2 as mii_pb
from fastgen.serving.grpc.proto import modelresponse_pb2_grpc as mii_grpc

CONFIG = dict(num_kv_blocks=64, block_size=8, token_budget=32, max_seqs=8, progress=False)
KEYS = ("first-key", "second-key")
HELLO = pb.GenerateRequest(prompts=[pb.Prompt(text="Hello")], params=pb.SamplingParams(max_new_tokens=2))
MII_HELLO = mii_pb.MultiStringRequest(request=["Hello"], query_kwargs={"max_new_tokens": mii_pb.Value(ivalue=2)})


@pytest.fixture(scope="module")
def backend(tiny_checkpoints):
    backend = LocalBackend(EngineLoop(Engine.from_config(EngineConfig(model=tiny_checkpoints["llama"], **CONFIG))), "tiny")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def keyed(backend):
    """A server requiring either key; Terminate only counts (so the server outlives the test)."""
    terminations = []
    server = GrpcServer("127.0.0.1", 0, deployment_name="tiny", backend=backend,
                        limits=ServingLimits(api_keys=KEYS), on_terminate=lambda: terminations.append(1))
    server.start()
    channel = grpc.insecure_channel(server.address)
    server.terminations = terminations
    server.channel = channel
    yield server
    channel.close()
    server.stop(grace=0)


def _methods(channel):
    """name -> a call of that method which returns once it has its (whole) answer."""
    typed, mii = pb_grpc.FastGenStub(channel), mii_grpc.ModelResponseStub(channel)
    return {
        "Generate": lambda md: typed.Generate(HELLO, metadata=md, timeout=30),
        "GenerateStream": lambda md: list(typed.GenerateStream(HELLO, metadata=md, timeout=30)),
        "Tokenize": lambda md: typed.Tokenize(pb.TokenizeRequest(texts=["Hello"]), metadata=md, timeout=30),
        "ModelInfo": lambda md: typed.ModelInfo(pb.ModelInfoRequest(), metadata=md, timeout=30),
        "Terminate": lambda md: typed.Terminate(pb.TerminateRequest(), metadata=md, timeout=30),
        "mii.GeneratorReply": lambda md: mii.GeneratorReply(MII_HELLO, metadata=md, timeout=30),
        "mii.GeneratorReplyStream": lambda md: list(mii.GeneratorReplyStream(MII_HELLO, metadata=md, timeout=30)),
        "mii.Terminate": lambda md: mii.Terminate(empty_pb2.Empty(), metadata=md, timeout=30),
    }


@pytest.mark.parametrize("metadata, message", [
    ((), "requires an API key: send the metadata 'authorization: Bearer <key>'"),
    ((("authorization", "Bearer wrong-key"),), "the API key is not valid"),
    ((("authorization", "Bearer first-ke"),), "the API key is not valid"),  # a prefix of a real key
    ((("authorization", "first-key"),), "must be 'Bearer <key>'"),
    ((("authorization", "Basic Zmlyc3Qta2V5"),), "must be 'Bearer <key>'"),
])
def test_every_method_refuses_a_missing_or_wrong_key(keyed, backend, metadata, message):
    for name, call in _methods(keyed.channel).items():
        with pytest.raises(grpc.RpcError) as err:
            call(metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert message in err.value.details(), (name, err.value.details())
    assert keyed.terminations == [] and not keyed.terminated.is_set()  # no refused Terminate ran
    assert not backend.engine.requests


def test_every_method_works_with_either_key(keyed):
    for key in KEYS:
        answers = {name: call((("authorization", f"Bearer {key}"),)) for name, call in _methods(keyed.channel).items()}
        assert answers["Generate"].completions[0].generated_length == 2
        assert answers["GenerateStream"][-1].finish_reason == "length"
        assert answers["Tokenize"].token_ids[0].ids and answers["ModelInfo"].deployment_name == "tiny"
        assert answers["mii.GeneratorReply"].response[0].generated_tokens == 2
        assert answers["mii.GeneratorReplyStream"][-1].response[0].finish_reason == "length"
    assert len(keyed.terminations) == 4  # both Terminates, with each key


def test_health_and_reflection_stay_open(keyed):
    health = health_pb2_grpc.HealthStub(keyed.channel)
    for service in ("", TYPED_SERVICE, MII_SERVICE):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING
    assert {TYPED_SERVICE, MII_SERVICE} <= set(ProtoReflectionDescriptorDatabase(keyed.channel).get_services())
    with Client(keyed.address) as keyless:
        assert keyless.health() == "SERVING"


def test_python_clients_send_their_key_or_the_environments(keyed, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with Client(keyed.address) as keyless:
        with pytest.raises(PermissionError, match="requires an API key.*FASTGEN_API_KEY"):
            keyless.generate("Hello", max_new_tokens=2)
        with pytest.raises(PermissionError):
            list(keyless.stream("Hello", max_new_tokens=2))
        with pytest.raises(PermissionError):
            keyless.terminate_server(timeout=1)
    with Client(keyed.address, api_key="wrong") as wrong, pytest.raises(PermissionError, match="not valid"):
        wrong.model_info()
    with Client(keyed.address, api_key="second-key") as right:
        assert right.generate("Hello", max_new_tokens=2)[0].generated_length == 2
        assert right.tokenize("Hello") == keyed.backend().tokenizer.encode("Hello")
    with client(keyed.address, api_key="first-key") as by_address:
        assert by_address.model_info()["deployment_name"] == "tiny"

    monkeypatch.setenv(API_KEY_ENV, "second-key,first-key")  # the first of the environment's keys is sent
    with Client(keyed.address) as from_env:
        assert [r.generated_length for r in from_env.generate(["Hello", [5, 6]], max_new_tokens=2)] == [2, 2]

    async def main():
        async with AsyncClient(keyed.address) as env_key, AsyncClient(keyed.address, api_key="nope") as bad:
            got = await env_key.generate("Hello", max_new_tokens=2)
            with pytest.raises(PermissionError):
                await bad.generate("Hello", max_new_tokens=2)
            return got

    assert asyncio.run(main())[0].generated_length == 2
    for bad_key in ("", " padded "):
        with pytest.raises(ValueError, match="API key"):
            Client(keyed.address, api_key=bad_key)


def _self_signed(directory):
    """(cert, key) PEM files for CN/SAN localhost and 127.0.0.1."""
    cert, key = str(directory / "cert.pem"), str(directory / "key.pem")
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor openssl is available to make a certificate")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                               x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .sign(private, hashes.SHA256()))
    with open(cert, "wb") as f:
        f.write(certificate.public_bytes(serialization.Encoding.PEM))
    with open(key, "wb") as f:
        f.write(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    return cert, key


def test_tls_with_a_self_signed_certificate(backend, tmp_path):
    cert, key = _self_signed(tmp_path)
    server = GrpcServer("127.0.0.1", 0, backend=backend, limits=ServingLimits(api_keys=KEYS), tls_cert=cert,
                        tls_key=key)
    server.start()
    try:
        assert server.tls
        for host in ("127.0.0.1", "localhost"):
            with Client(f"{host}:{server.port}", api_key="first-key", tls_root_cert=cert) as secure:
                assert secure.generate("Hello", max_new_tokens=2)[0].generated_length == 2
                assert secure.health() == "SERVING"
        with Client(server.address, tls_root_cert=cert, api_key="wrong") as wrong, pytest.raises(PermissionError):
            wrong.generate("Hello", max_new_tokens=2)
        with Client(server.address, api_key="first-key") as plain, pytest.raises(ConnectionError):
            plain.generate("Hello", max_new_tokens=2)  # plain TCP to a TLS port: no handshake, no call

        async def main():
            async with AsyncClient(server.address, api_key="second-key", tls_root_cert=cert) as secure:
                return await secure.generate("Hello", max_new_tokens=2)

        assert asyncio.run(main())[0].generated_length == 2
    finally:
        server.stop(grace=0)

    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        GrpcServer(tls_cert=cert)
    with pytest.raises(ValueError, match="tls_key: cannot read"):
        GrpcServer(tls_cert=cert, tls_key=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="tls_root_cert: .* is not a PEM file"):
        Client("127.0.0.1:1", tls_root_cert=__file__)
