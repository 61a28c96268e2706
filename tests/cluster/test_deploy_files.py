"""Every command line in deploy/ is accepted by the real gcache-server / gcache-master parsers.

Every file under deploy/ is read: Kubernetes YAML (container command/args, with
$(VAR) from the downward API filled in, once per StatefulSet replica), systemd units (ExecStart with line continuations, ${VAR} / $VAR from
Environment= and the example EnvironmentFile), the Containerfile's ENTRYPOINT +
CMD, the example TOML config and the commands in deploy/README.md. Then the
structure that matters for a cluster: replicas, volumes at --data-dir, probes
on the admin port, memory limit above --memory, every port a flag value.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
import yaml

from gcache.server.config import build_parser, load_settings
from tests.support import REPO_ROOT
from tests.support.servers import run_server_cli

DEPLOY = REPO_ROOT / "deploy"
EXAMPLE_CONFIG = DEPLOY / "gcache-server.toml"
EXAMPLE_AUTH = DEPLOY / "gcache-auth.example.toml"
PROGRAMS = ("gcache-server", "gcache-master")
NAMESPACE = "gcache-test"  # plausible values for the downward API
FIELD_VALUES = {
    "metadata.namespace": NAMESPACE,
    "spec.nodeName": "gpu-node-7",
    "status.hostIP": "10.0.0.17",
    "status.podIP": "10.244.3.9",
}
POD_KINDS = ("Pod", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")


@dataclass
class Command:
    where: str  # file and place, for messages
    program: str  # gcache-server | gcache-master
    argv: list[str]  # after the program name, placeholders filled in
    raw_argv: list[str] = field(default_factory=list)  # before (k8s only)
    doc: dict | None = None  # the Kubernetes object it came from
    container: dict | None = None
    pod_name: str = ""


# ---------------------------------------------------------------- file kinds


def deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file())


def kind_of(path: Path) -> str:
    name = path.name
    if name.endswith((".yaml", ".yml")):
        return "k8s"
    if name.endswith(".service"):
        return "systemd"
    if name.endswith(".env.example"):
        return "envfile"
    if name == "Containerfile" or name == "Dockerfile":
        return "containerfile"
    if name.endswith(".toml"):
        return "toml"
    if name.endswith(".md"):
        return "markdown"
    return "unknown"


def test_every_deploy_file_is_of_a_checked_kind():
    unknown = [str(p.relative_to(DEPLOY)) for p in deploy_files() if kind_of(p) == "unknown"]
    assert not unknown, f"deploy/ files this test does not check (teach kind_of about them): {unknown}"


# ---------------------------------------------------------------- parsers


def server_flags() -> set[str]:
    return {opt for action in build_parser()._actions for opt in action.option_strings}


def master_main():
    from gcache.master import main  # imported late: the server checks do not need it

    return main


def with_local_config(args: list[str]) -> list[str]:
    """Points --config and --auth-file at the repository's examples (the deploy paths don't
    exist here); a config file's auth-file is overridden the same way."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg in ("--config", "--auth-file") and i + 1 < len(out):
            out[i + 1] = str(EXAMPLE_CONFIG if arg == "--config" else EXAMPLE_AUTH)
        elif arg.startswith("--config="):
            out[i] = "--config=" + str(EXAMPLE_CONFIG)
        elif arg.startswith("--auth-file="):
            out[i] = "--auth-file=" + str(EXAMPLE_AUTH)
    if any(a == "--config" or a.startswith("--config=") for a in out):
        out += ["--auth-file", str(EXAMPLE_AUTH)]
    return out


def parse_server(cmd: Command):
    flags = {a.split("=", 1)[0] for a in cmd.argv if a.startswith("--")}
    assert flags, f"{cmd.where}: no flags found"
    unknown = flags - server_flags()
    assert not unknown, f"{cmd.where} uses flags gcache-server does not know: {sorted(unknown)}"
    try:
        return load_settings(with_local_config(cmd.argv))  # raises ConfigError on a bad value
    except SystemExit as e:
        pytest.fail(f"{cmd.where}: gcache-server rejects {cmd.argv} (exit {e.code})")


def parse_master(cmd: Command):
    """gcache-master's own path: build_parser().parse_args, then validate (what main() does)."""
    main = master_main()
    parser = main.build_parser()
    known = {opt for action in parser._actions for opt in action.option_strings}
    unknown = {a.split("=", 1)[0] for a in cmd.argv if a.startswith("--")} - known
    assert not unknown, f"{cmd.where} uses flags gcache-master does not know: {sorted(unknown)}"
    try:
        args = parser.parse_args(cmd.argv)
    except SystemExit as e:
        pytest.fail(f"{cmd.where}: gcache-master rejects {cmd.argv} (exit {e.code})")
    try:
        main.validate(args)
    except main.UsageError as e:
        pytest.fail(f"{cmd.where}: gcache-master rejects {cmd.argv}: {e}")
    return args


def parse(cmd: Command):
    return parse_server(cmd) if cmd.program == "gcache-server" else parse_master(cmd)


def program_of(word: str) -> str | None:
    base = word.rsplit("/", 1)[-1]
    return base if base in PROGRAMS else None


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V`; the last one wins, as in argparse."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def port_of(address: str) -> int:
    host, sep, port = address.rpartition(":")
    assert sep and port.isdigit(), f"{address!r} is not host:port"
    return int(port)


# ---------------------------------------------------------------- systemd


def unit_settings(text: str) -> dict[str, list[str]]:
    """{'Section.Key': [values]} with backslash line continuations joined."""
    out: dict[str, list[str]] = {}
    section, pending = "", ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped[0] in "#;"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical, pending = pending + stripped, ""
        if logical.startswith("[") and logical.endswith("]"):
            section = logical[1:-1]
            continue
        key, sep, value = logical.partition("=")
        assert sep, f"not a key=value line: {logical!r}"
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def env_assignments(values: list[str]) -> dict[str, str]:
    env = {}
    for value in values:
        for word in shlex.split(value):
            key, sep, val = word.partition("=")
            assert sep, f"Environment= word {word!r} is not KEY=VALUE"
            env[key] = val
    return env


def env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, val = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
        if len(val) >= 2 and val[0] == val[-1] and val[0] in "'\"":
            val = val[1:-1]
        env[key.strip()] = val
    return env


def expand_systemd(exec_start: str, env: dict[str, str], where: str) -> list[str]:
    """systemd's rules: a word that is exactly $VAR becomes its value split on
    whitespace (zero or more words); ${VAR} is replaced inside a word as one word."""
    words = shlex.split(exec_start)
    while words and words[0][:1] in "-@+!:":
        words[0] = words[0][1:]

    def braced(match):
        assert match.group(1) in env, f"{where}: ${{{match.group(1)}}} is set by no Environment= line"
        return env[match.group(1)]

    out = []
    for word in words:
        bare = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if bare:
            assert bare.group(1) in env, f"{where}: ${bare.group(1)} is set by no Environment= line"
            out.extend(env[bare.group(1)].split())
        else:
            out.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", braced, word))
    return out


def example_env_path(unit_path: Path, env_file_setting: str) -> Path:
    return unit_path.parent / (Path(env_file_setting.lstrip("-")).name + ".example")


def systemd_commands(path: Path) -> list[Command]:
    """One command for the unit's defaults, one more per example EnvironmentFile."""
    settings = unit_settings(path.read_text())
    exec_lines = settings.get("Service.ExecStart", [])
    assert len(exec_lines) == 1, f"{path.name}: expected one ExecStart, got {exec_lines}"
    defaults = env_assignments(settings.get("Service.Environment", []))
    variants = [("defaults", defaults)]
    for setting in settings.get("Service.EnvironmentFile", []):
        example = example_env_path(path, setting)
        assert example.is_file(), f"{path.name}: EnvironmentFile {setting} has no {example.name} beside it"
        variants.append((example.name, {**defaults, **env_file(example)}))  # the file wins
    out = []
    for label, env in variants:
        where = f"deploy/{path.relative_to(DEPLOY)} ({label})"
        argv = expand_systemd(exec_lines[0], env, where)
        program = program_of(argv[0])
        assert program, f"{where}: ExecStart runs {argv[0]}, not one of {PROGRAMS}"
        out.append(Command(where, program, argv[1:]))
    return out


# ---------------------------------------------------------------- Kubernetes


def yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_k8s_docs() -> list[dict]:
    return [d for p in deploy_files() if kind_of(p) == "k8s" for d in yaml_docs(p)]


def pod_spec(doc: dict) -> dict | None:
    if doc.get("kind") == "Pod":
        return doc["spec"]
    if doc.get("kind") in POD_KINDS:
        return doc["spec"]["template"]["spec"]
    return None


def pod_names(doc: dict) -> list[str]:
    name = doc["metadata"]["name"]
    if doc["kind"] == "StatefulSet":
        return [f"{name}-{i}" for i in range(doc["spec"].get("replicas", 1))]
    return [name if doc["kind"] == "Pod" else f"{name}-x7k2p"]


def container_env(container: dict, pod_name: str, where: str) -> dict[str, str]:
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand_k8s(str(var["value"]), env)
            continue
        ref = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        assert ref, f"{where}: env {var['name']} comes from something this test cannot fill in"
        assert ref == "metadata.name" or ref in FIELD_VALUES, f"{where}: no plausible value for {ref}"
        env[var["name"]] = pod_name if ref == "metadata.name" else FIELD_VALUES[ref]
    return env


def expand_k8s(text: str, env: dict[str, str]) -> str:
    """Kubernetes' rules: $(VAR) of a defined variable is replaced, $$ is a literal $,
    anything else is left as written."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def k8s_commands(path: Path) -> list[Command]:
    out = []
    for doc in yaml_docs(path):
        spec = pod_spec(doc)
        if spec is None:
            continue
        containers = spec.get("initContainers", []) + spec["containers"]
        for container in containers:
            for pod_name in pod_names(doc):
                where = (
                    f"deploy/{path.relative_to(DEPLOY)} {doc['kind']}/{doc['metadata']['name']} "
                    f"container {container['name']} pod {pod_name}"
                )
                env = container_env(container, pod_name, where)
                raw = list(container.get("command", [])) + list(container.get("args", []))
                if not container.get("command"):
                    raw = containerfile_entrypoint() + raw  # the image's ENTRYPOINT
                words = [expand_k8s(str(w), env) for w in raw]
                program = program_of(words[0])
                assert program or not any(p in " ".join(words) for p in PROGRAMS), (
                    f"{where}: runs {words[0]}, not the program itself; give command: [the program] "
                    "and args (or teach this test to read that entry)"
                )
                if program:
                    out.append(
                        Command(
                            where,
                            program,
                            words[1:],
                            raw_argv=[str(w) for w in raw[1:]],
                            doc=doc,
                            container=container,
                            pod_name=pod_name,
                        )
                    )
    return out


# ---------------------------------------------------------------- Containerfile, README


def containerfile_entrypoint() -> list[str]:
    text = (DEPLOY / "Containerfile").read_text()
    return json.loads(re.search(r"^ENTRYPOINT (\[.+\])$", text, re.M).group(1))


def containerfile_commands(path: Path) -> list[Command]:
    text = path.read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.+\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.+\])$", text, re.M).group(1))
    program = program_of(entry[0])
    assert program, f"{path.name}: ENTRYPOINT runs {entry[0]}"
    return [Command(f"deploy/{path.name}", program, entry[1:] + cmd)]


def markdown_commands(path: Path) -> list[Command]:
    """gcache-server / gcache-master command lines in the fenced code blocks."""
    out = []
    blocks = re.findall(r"^[ \t]*```[a-z]*\n(.*?)^[ \t]*```", path.read_text(), re.M | re.S)
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for i, word in enumerate(words[:3]):  # after e.g. `sudo -u gcache`
                program = program_of(word)
                if program and (word == program or word.endswith("/bin/" + program)):
                    argv = words[i + 1 :]
                    if "--help" not in argv:
                        out.append(Command(f"deploy/{path.relative_to(DEPLOY)}: {line.strip()[:60]}", program, argv))
                    break
    return out


@cache
def commands_in(path: Path) -> tuple[Command, ...]:
    kind = kind_of(path)
    if kind == "k8s":
        return tuple(k8s_commands(path))
    if kind == "systemd":
        return tuple(systemd_commands(path))
    if kind == "containerfile":
        return tuple(containerfile_commands(path))
    if kind == "markdown":
        return tuple(markdown_commands(path))
    return ()


def all_commands() -> list[Command]:
    return [c for p in deploy_files() for c in commands_in(p)]


# ---------------------------------------------------------------- every flag


@pytest.mark.parametrize(
    "path",
    [p for p in deploy_files() if kind_of(p) in ("k8s", "systemd", "containerfile", "markdown")],
    ids=lambda p: str(p.relative_to(DEPLOY)),
)
def test_every_command_line_is_accepted_by_the_real_parser(path):
    for cmd in commands_in(path):
        parse(cmd)


def test_both_programs_are_deployed_by_kubernetes_and_systemd():
    found = {(kind_of(p), c.program) for p in deploy_files() for c in commands_in(p)}
    for kind in ("k8s", "systemd"):
        for program in PROGRAMS:
            assert (kind, program) in found, f"no {program} command in the {kind} files"


def test_example_config_keys_are_flags_and_load():
    raw = tomllib.loads(EXAMPLE_CONFIG.read_text())
    flags = server_flags()
    for key in raw:
        assert "--" + key.replace("_", "-") in flags, f"config key {key!r} is not a gcache-server flag"
    settings = load_settings(with_local_config(["--config", str(EXAMPLE_CONFIG)]))
    assert settings.memory == 16 << 30 and settings.data_dir == "/var/lib/gcache"


def test_every_deployed_daemon_authenticates_and_masters_serve_tls():
    """The shipped files turn authentication on: every node and master reads a tenants
    file, masters serve TLS and nodes in a cluster check the masters' certificates."""
    raw = tomllib.loads(EXAMPLE_CONFIG.read_text())
    assert raw["auth-file"].startswith("/etc/gcache/")
    seen = set()
    for path in deploy_files():
        if kind_of(path) not in ("k8s", "systemd", "containerfile"):
            continue
        for cmd in commands_in(path):
            seen.add(cmd.program)
            if cmd.program == "gcache-master":
                args = parse_master(cmd)
                assert args.auth_file and args.tls_cert and args.tls_key, cmd.where
            else:
                uses_config = any(a == "--config" or a.startswith("--config=") for a in cmd.argv)
                assert uses_config or flag_value(cmd.argv, "--auth-file"), cmd.where
                settings = parse_server(cmd)
                assert settings.auth is not None and settings.auth.cluster_token()
                if settings.master:
                    assert settings.master_tls_ca, f"{cmd.where}: a cluster node should check the masters' TLS"
    assert seen == set(PROGRAMS)


@pytest.mark.process
def test_example_auth_file_loads_and_placeholders_are_refused_at_start(tmp_path):
    from gcache.wire.auth import load_auth_file, placeholder_tenants

    auth = load_auth_file(str(EXAMPLE_AUTH))
    assert {n: sorted(t.roles) for n, t in auth.tenants.items()} == {
        "nodes": ["cluster"],
        "ops": ["admin"],
        "engines": ["read", "write"],
    }
    assert placeholder_tenants(auth) == ["engines", "nodes", "ops"]
    out = run_server_cli("--auth-file", str(EXAMPLE_AUTH), "--port", "0", "--data-dir", str(tmp_path))
    assert out.returncode == 2 and "placeholder token" in out.stderr


def test_command_line_overrides_config_file():
    settings = load_settings(with_local_config(["--config", str(EXAMPLE_CONFIG), "--memory", "2GiB", "--port", "9000"]))
    assert settings.memory == 2 << 30 and settings.port == 9000
    assert settings.disk == 200 << 30  # still from the file


# ---------------------------------------------------------------- systemd structure


def test_systemd_units():
    server = unit_settings((DEPLOY / "systemd" / "gcache-server.service").read_text())
    assert server["Service.RestartPreventExitStatus"] == ["2 3"]
    assert server["Service.Restart"] == ["on-failure"]
    master = unit_settings((DEPLOY / "systemd" / "gcache-master.service").read_text())
    assert master["Service.Type"] == ["simple"] and master["Service.Restart"] == ["on-failure"]
    state_dir = master["Service.StateDirectory"][0]
    for cmd in systemd_commands(DEPLOY / "systemd" / "gcache-master.service"):
        assert parse_master(cmd).data_dir == f"/var/lib/{state_dir}", cmd.where


def test_systemd_server_is_standalone_by_default_and_joins_with_the_example_env():
    default, cluster = systemd_commands(DEPLOY / "systemd" / "gcache-server.service")
    assert flag_value(default.argv, "--master") is None
    for flag in ("--master", "--node-id", "--advertise"):
        assert flag_value(cluster.argv, flag), f"{cluster.where}: no {flag}"
    settings = parse_server(cluster)
    assert port_of(flag_value(cluster.argv, "--advertise")) == settings.port


def test_systemd_master_replicas_name_each_other():
    default, three = systemd_commands(DEPLOY / "systemd" / "gcache-master.service")
    assert flag_value(default.argv, "--peers") is None  # one replica
    peers = flag_value(three.argv, "--peers").split(",")
    raft = flag_value(three.argv, "--raft")
    assert len(peers) == 2 and raft not in peers and not raft.startswith("127.")


# ---------------------------------------------------------------- Kubernetes structure


def k8s_objects(kind: str, name: str | None = None) -> list[dict]:
    return [d for d in all_k8s_docs() if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]


def k8s_commands_of(doc: dict, program: str) -> list[Command]:
    return [
        c
        for p in deploy_files()
        if kind_of(p) == "k8s"
        for c in commands_in(p)
        if c.doc is not None
        and c.doc["kind"] == doc["kind"]
        and c.doc["metadata"]["name"] == doc["metadata"]["name"]
        and c.program == program
    ]


def container_port(container: dict, port) -> int:
    """A probe's or Service's port: a number, or the name of a container port."""
    if isinstance(port, int):
        return port
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"port {port!r} names no container port of {container['name']}"
    return named[port]


def check_probes(container: dict, port: int, where: str) -> None:
    expected = {"readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
        probe = container.get(probe_name)
        if probe is None:
            assert probe_name == "startupProbe", f"{where}: no {probe_name}"
            continue
        get = probe.get("httpGet")
        assert get, f"{where}: {probe_name} is not an HTTP GET"
        assert container_port(container, get["port"]) == port, (
            f"{where}: {probe_name} probes port {get['port']}, the HTTP flag says {port}"
        )
        assert get["path"] == expected.get(probe_name, get["path"]) and get["path"] in ("/healthz", "/readyz"), (
            f"{where}: {probe_name} path {get['path']}"
        )


def mount_path_of(container: dict, volume_name: str) -> str | None:
    for mount in container.get("volumeMounts", []):
        if mount["name"] == volume_name:
            return mount["mountPath"]
    return None


def quantity_bytes(text) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGTPE]i?|k)?", str(text))
    assert match, f"memory quantity {text!r} not understood"
    units = {
        None: 1,
        "k": 10**3,
        "K": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
        "P": 10**15,
        "E": 10**18,
        "Ki": 1 << 10,
        "Mi": 1 << 20,
        "Gi": 1 << 30,
        "Ti": 1 << 40,
        "Pi": 1 << 50,
        "Ei": 1 << 60,
    }
    return int(float(match.group(1)) * units[match.group(2)])


def test_manifests_are_namespace_agnostic():
    docs = all_k8s_docs()
    assert docs
    for doc in docs:
        assert "namespace" not in doc.get("metadata", {}), (
            f"{doc['kind']}/{doc['metadata']['name']} pins a namespace; apply with kubectl -n instead"
        )


def master_statefulset() -> dict:
    found = k8s_objects("StatefulSet", "gcache-master")
    assert len(found) == 1, "one StatefulSet gcache-master"
    return found[0]


def test_master_statefulset():
    sts = master_statefulset()
    spec = sts["spec"]
    assert spec["replicas"] == 3
    assert spec.get("podManagementPolicy") == "Parallel", "replicas must start together to form a quorum"
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()

    headless = k8s_objects("Service", spec["serviceName"])
    assert headless, f"no Service {spec['serviceName']} (the StatefulSet's serviceName)"
    headless = headless[0]["spec"]
    assert headless["clusterIP"] == "None" and headless.get("publishNotReadyAddresses") is True
    assert headless["selector"].items() <= labels.items()

    claims = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
    assert claims, "the master keeps its Raft state on a volumeClaimTemplate"
    commands = k8s_commands_of(sts, "gcache-master")
    assert [c.pod_name for c in commands] == [f"gcache-master-{i}" for i in range(3)]
    for i, cmd in enumerate(commands):
        args = parse_master(cmd)
        container = cmd.container
        mounts = {mount_path_of(container, c) for c in claims}
        assert args.data_dir in mounts, f"{cmd.where}: --data-dir {args.data_dir} is not a claimed volume"
        domain = f"{spec['serviceName']}.{NAMESPACE}.svc"
        raft_port = port_of(args.raft)
        assert args.raft == f"gcache-master-{i}.{domain}:{raft_port}", cmd.where
        # The same list on every replica is fine: gcache-master drops its own --raft from it.
        peers = set(master_main().validate(args)["peers"])
        assert peers == {f"gcache-master-{j}.{domain}:{raft_port}" for j in range(3) if j != i}, (
            f"{cmd.where}: --peers {sorted(peers)}"
        )
        grpc_port, http_port = port_of(args.grpc), port_of(args.http)
        assert {p["containerPort"] for p in container["ports"]} == {grpc_port, raft_port, http_port}
        assert {container_port(container, p["targetPort"]) for p in headless["ports"]} <= {grpc_port, raft_port}
        check_probes(container, http_port, cmd.where)
        resources = container["resources"]
        assert resources["requests"].get("memory") and resources["requests"].get("cpu")
        assert resources["limits"].get("memory")


def test_master_client_service_reaches_the_grpc_port():
    sts = master_statefulset()
    labels = sts["spec"]["template"]["metadata"]["labels"]
    cmd = k8s_commands_of(sts, "gcache-master")[0]
    grpc_port = port_of(parse_master(cmd).grpc)
    clients = [
        s
        for s in k8s_objects("Service")
        if s["spec"].get("clusterIP") != "None" and s["spec"]["selector"].items() <= labels.items()
    ]
    assert clients, "no (non-headless) client Service for the masters"
    for svc in clients:
        targets = {container_port(cmd.container, p.get("targetPort", p["port"])) for p in svc["spec"]["ports"]}
        assert targets == {grpc_port}, f"Service {svc['metadata']['name']} targets {targets}"


def server_daemonset() -> dict:
    found = k8s_objects("DaemonSet", "gcache-server")
    assert len(found) == 1, "one DaemonSet gcache-server"
    return found[0]


def test_server_daemonset_runs_on_gpu_hosts_on_the_host_network():
    ds = server_daemonset()
    pod = ds["spec"]["template"]["spec"]
    assert pod.get("hostNetwork") is True
    assert pod.get("dnsPolicy") == "ClusterFirstWithHostNet", "host network pods need it to resolve Services"
    placement = json.dumps({k: pod.get(k) for k in ("nodeSelector", "affinity")})
    assert "nvidia.com/gpu" in placement, "the DaemonSet should select GPU hosts"
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", []))
    for container in pod["containers"]:
        for section in ("requests", "limits"):
            assert "nvidia.com/gpu" not in container.get("resources", {}).get(section, {}), (
                "the server uses no GPU: requesting one takes it from the engines"
            )


def test_server_daemonset_flags_volumes_probes_and_memory():
    ds = server_daemonset()
    pod = ds["spec"]["template"]["spec"]
    commands = k8s_commands_of(ds, "gcache-server")
    assert len(commands) == 1
    cmd = commands[0]
    settings = parse_server(cmd)
    container = cmd.container

    host_paths = {v["name"] for v in pod.get("volumes", []) if "hostPath" in v}
    assert settings.data_dir in {mount_path_of(container, v) for v in host_paths}, (
        f"--data-dir {settings.data_dir} is not on a hostPath volume"
    )

    limit = quantity_bytes(container["resources"]["limits"]["memory"])
    request = quantity_bytes(container["resources"]["requests"]["memory"])
    assert limit > settings.memory and request > settings.memory, (
        "the memory limit must exceed --memory: the index, page cache and process are not in it"
    )

    check_probes(container, settings.admin_port, cmd.where)
    ports = container["ports"]
    assert {p["containerPort"] for p in ports} <= {settings.port, settings.admin_port, settings.grpc_port}
    assert {settings.port, settings.admin_port} <= {p["containerPort"] for p in ports}
    assert all(p.get("hostPort", p["containerPort"]) == p["containerPort"] for p in ports)

    assert pod["terminationGracePeriodSeconds"] >= settings.shutdown_grace_s + 60, (
        "SIGTERM writes the memory tier to disk: give it time before SIGKILL"
    )


def test_server_daemonset_cluster_flags():
    ds = server_daemonset()
    cmd = k8s_commands_of(ds, "gcache-server")[0]
    settings = parse_server(cmd)
    env = {v["name"]: v.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for v in cmd.container.get("env", [])}

    node_id = flag_value(cmd.raw_argv, "--node-id")
    assert re.fullmatch(r"\$\((\w+)\)", node_id) and env[node_id[2:-1]] == "spec.nodeName", (
        f"--node-id {node_id} should be the node name from the downward API"
    )
    advertise = flag_value(cmd.raw_argv, "--advertise")
    host_var, _, port = advertise.partition(":")
    assert re.fullmatch(r"\$\((\w+)\)", host_var) and env[host_var[2:-1]] == "status.hostIP", advertise
    assert int(port) == settings.port, "--advertise must name the data port"
    assert flag_value(cmd.argv, "--advertise") == f"{FIELD_VALUES['status.hostIP']}:{settings.port}"

    sts = master_statefulset()
    replicas = sts["spec"]["replicas"]
    master_cmd = k8s_commands_of(sts, "gcache-master")[0]
    grpc_port = port_of(parse_master(master_cmd).grpc)
    service = sts["spec"]["serviceName"]
    pod_hosts = {f"gcache-master-{i}.{service}" for i in range(replicas)}
    pod_hosts |= {f"{h}.{NAMESPACE}.svc" for h in pod_hosts}
    client_services = {s["metadata"]["name"] for s in k8s_objects("Service") if s["spec"].get("clusterIP") != "None"}
    masters = flag_value(cmd.argv, "--master").split(",")
    for address in masters:
        host, _, port = address.rpartition(":")
        assert host in pod_hosts | client_services, f"--master {address} is neither a master pod nor Service"
        assert int(port) == grpc_port, f"--master {address}: the masters' gRPC port is {grpc_port}"
    if not set(h.rpartition(":")[0] for h in masters) & client_services:
        assert len(masters) == replicas, "list every master replica, so a node survives one going away"
