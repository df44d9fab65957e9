"""What we would upload: the wheel and the sdist, built as a release builds them.

* the wheel carries everything the package loads at run time (Lua scripts, py.typed,
  the web dashboard's page), and so does the sdist;
* its metadata is what PyPI shows: SPDX license, project URLs, classifiers that match
  the tested matrix (tox.ini), a long description without relative links;
* the sdist carries a test suite that runs (conftest, harness, apps, benchmarks);
* a plain ``pip install`` of the wheel, no extras, in a fresh virtualenv, is enough to
  run ``celery redlock``, a prefork worker and a ``LeaderScheduler`` beat on a Redis
  broker (kombu's Redis transport needs redis-py and ``packaging``, which only
  ``kombu[redis]`` brings).
"""

from __future__ import annotations

import configparser
import email
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
import redis

from tests.harness import BeatProcess, WorkerProcess, wait_for

pytest.importorskip("build", reason="build: in the 'test' extra, not 'test-core'")

ROOT = Path(__file__).resolve().parents[1]
REPOSITORY = "https://github.com/celery-redlock/celery_redlock"


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel, built from the checkout by ``python -m build``."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        cwd=out,
    )
    (wheel,) = out.glob("celery_redlock-*.whl")
    (sdist,) = out.glob("celery_redlock-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(archive.read(name))


def test_wheel_ships_lua_scripts_and_py_typed(dist, tmp_path):
    """Install the wheel apart from the source tree and load every script."""
    wheel = dist["wheel"]
    names = zipfile.ZipFile(wheel).namelist()
    lua = sorted(Path(n).name for n in names if n.endswith(".lua"))
    shipped = sorted(p.name for p in (ROOT / "celery_redlock" / "engine" / "scripts").glob("*.lua"))
    assert lua == shipped
    assert "celery_redlock/py.typed" in names
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
    )
    probe = (
        "import celery_redlock, celery_redlock.engine.scripts as s; "
        f"assert celery_redlock.__file__.startswith({str(target)!r}), celery_redlock.__file__; "
        "print(len([s.ACQUIRE, s.RENEW_MANY, s.RELEASE, s.RELEASE_IF, s.FENCE_SYNC, "
        "s.INSPECT]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == "6"


def test_wheel_and_sdist_ship_the_web_dashboards_page(dist):
    """`celery redlock web` serves its HTML, JS and CSS from the installed package."""
    static = ROOT / "celery_redlock" / "ops" / "web" / "static"
    shipped = sorted(p.name for p in static.iterdir() if p.is_file())
    assert {"index.html", "app.js", "app.css"} <= set(shipped)
    wheel = zipfile.ZipFile(dist["wheel"]).namelist()
    assert sorted(Path(n).name for n in wheel if "celery_redlock/ops/web/static/" in n) == shipped
    with tarfile.open(dist["sdist"]) as sdist:
        names = sdist.getnames()
    in_sdist = sorted(Path(n).name for n in names if "/celery_redlock/ops/web/static/" in n)
    assert in_sdist == shipped


def test_metadata_is_what_pypi_should_show(dist):
    """SPDX license, project URLs, the Redis extra of kombu, and no relative link."""
    meta = metadata(dist["wheel"])
    assert meta["License-Expression"] == "MIT"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert not meta.get_all("Classifier") or not any(
        c.startswith("License ::") for c in meta.get_all("Classifier")
    ), "a License classifier next to License-Expression is refused by PyPI"
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert urls["Source"] == REPOSITORY
    assert all(u.startswith(REPOSITORY) for u in urls.values()), urls
    requires = meta.get_all("Requires-Dist")
    assert any(re.match(r"kombu\[redis\]>=", r) for r in requires), requires

    description = meta.get_payload()
    assert meta["Description-Content-Type"] == "text/markdown"
    assert description.startswith("# celery_redlock")
    targets = re.findall(r"\]\(([^)\s]+)\)", description)
    assert targets, "the README has links"
    relative = [t for t in targets if not re.match(r"[a-z][a-z+.-]*:", t)]
    assert relative == [], "relative links break on PyPI"
    # Every link into the repository points at a file the repository has.
    for target in targets:
        for prefix in (
            f"{REPOSITORY}/blob/main/",
            "https://raw.githubusercontent.com/celery-redlock/celery_redlock/main/",
        ):
            if target.startswith(prefix):
                path, _, anchor = target.removeprefix(prefix).partition("#")
                assert (ROOT / path).is_file(), target
                if anchor and path.endswith(".md"):  # a heading of that file, as GitHub slugs it
                    headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
                    slugs = {
                        re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                        for h in headings
                    }
                    assert anchor in slugs, target


def test_python_classifiers_are_the_pythons_tox_tests(dist):
    """The ``Python :: 3.x`` classifiers name exactly the interpreters of tox.ini."""
    meta = metadata(dist["wheel"])
    classified = {
        c.rsplit(" :: ", 1)[1]
        for c in meta.get_all("Classifier")
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    }
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    tested = {
        re.fullmatch(r"python(3\.\d+)", tox[s]["base_python"]).group(1)
        for s in tox.sections()
        if "base_python" in tox[s]
    }
    assert classified == tested
    low = min(tested, key=lambda v: tuple(map(int, v.split("."))))
    assert meta["Requires-Python"] == f">={low}"


def test_sdist_ships_a_test_suite_that_runs(dist, tmp_path):
    """Unpacked, the sdist's tests all collect, and its harness runs a real server."""
    with tarfile.open(dist["sdist"]) as archive:
        # extraction filters exist from Python 3.11.4 (Debian's python3 is 3.11.2)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(tmp_path, **safe)  # our own sdist
    (tree,) = tmp_path.glob("celery_redlock-*")
    for needed in ("tests/conftest.py", "tests/harness/servers.py", "tests/apps/locked.py",
                   "tests/reliability/conftest.py", "benchmarks/__main__.py", "LICENSE",
                   "docs/reliability.md", "tox.ini"):  # fmt: skip
        assert (tree / needed).is_file(), needed
    # Not the checkout's copy of anything: the sdist's own tests, on the sdist's package.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=tree,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-2000:]
    assert re.search(r"^\d+ tests collected", collected.stdout, re.M), collected.stdout[-500:]
    # As a packager runs them after `pip install '.[test-core]'` (tox.ini's extra): what
    # needs more (the benchmark peers, Django, mkdocs, build) skips, saying which extra.
    core = subprocess.run(
        [sys.executable, "tests/harness/only_extra.py", "pyproject.toml", "test-core",
         "--collect-only", "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=tree, capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert core.returncode == 0, core.stdout[-3000:] + core.stderr[-2000:]
    assert "celery_once" in core.stderr, core.stderr[-500:]  # it was made unimportable
    assert re.search(r"^\d+ tests collected", core.stdout, re.M), core.stdout[-500:]
    skipped = re.findall(
        r"^SKIPPED \[1\] (\S+?):\d+: .*'(?:benchmarks|test|docs)'", core.stdout, re.M
    )
    assert sorted(skipped) == [
        "tests/integration/test_django.py",
        "tests/test_benchmarks_smoke.py",
        "tests/test_docs.py",
        "tests/test_packaging.py",
    ], core.stdout[-1500:]
    probe = "import celery_redlock, sys; print(celery_redlock.__file__)"
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/unit/engine/test_scripts.py", "-k", "acquire_grants or release_deletes"],
        cwd=tree, capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-2000:]
    assert re.search(r"^2 passed", ran.stdout, re.M), ran.stdout[-500:]
    where = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, '.'); {probe}"],
        cwd=tree, capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    assert where.stdout.strip().startswith(str(tree)), where.stdout


TINY_APP = textwrap.dedent(
    """
    import os

    import redis
    from celery import Celery

    from celery_redlock import LockedTask

    URL = os.environ["TINY_REDIS_URL"]
    app = Celery("tinyapp", broker=f"{URL}/1", backend=f"{URL}/2")
    app.conf.update(
        redlock_url=f"{URL}/0",
        imports=["celery_redlock"],
        broker_connection_retry_on_startup=True,
        beat_schedule={"tick": {"task": "tinyapp.tick", "schedule": 0.5}},
    )


    @app.task(base=LockedTask, bind=True, lock_args=("n",))
    def double(self, n):
        module = __import__("celery_redlock").__file__
        return {"n": 2 * n, "fence": self.lock.fence, "module": module}


    @app.task
    def tick():
        redis.Redis.from_url(f"{URL}/3").incr("ticks")
    """
)


class _VenvProcess:
    """Run the harness's worker or beat with another interpreter, outside the checkout."""

    python: Path
    app_dir: Path

    def command_line(self) -> list[str]:
        return [str(self.python), *super().command_line()[1:]]  # type: ignore[misc]

    def environment(self) -> dict[str, str]:
        env = super().environment()  # type: ignore[misc]
        env["PYTHONPATH"] = str(self.app_dir)  # the tiny app only, never the checkout
        return env


class VenvWorker(_VenvProcess, WorkerProcess):
    pass


class VenvBeat(_VenvProcess, BeatProcess):
    pass


def test_a_plain_install_of_the_wheel_runs_the_cli_a_worker_and_beat(dist, tmp_path, celery_redis):
    """``pip install celery_redlock-*.whl`` alone, in a fresh venv: worker, beat and CLI
    work on a Redis broker (before kombu[redis] was a dependency, kombu's transport
    could not import ``packaging`` there, or found a redis-py it refuses)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         str(dist["wheel"])],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-3000:]
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    (app_dir / "tinyapp.py").write_text(TINY_APP)
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
        "PYTHONPATH": str(app_dir),
        "TINY_REDIS_URL": celery_redis.url.rsplit("/", 1)[0],
    }
    celery = [str(python), "-m", "celery", "-A", "tinyapp"]

    helped = subprocess.run(
        [*celery, "redlock", "--help"], cwd=app_dir, env=env, capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    assert helped.returncode == 0, helped.stderr[-3000:]
    for command in ("ls", "inspect", "release", "doctor"):
        assert command in helped.stdout

    processes = []
    for cls, kw in ((VenvWorker, {"concurrency": 1}), (VenvBeat,
                    {"scheduler": "celery_redlock.beat:LeaderScheduler"})):  # fmt: skip
        process = cls("tinyapp", cwd=app_dir, env=env, log_dir=tmp_path / "logs", **kw)
        process.python, process.app_dir = python, app_dir
        processes.append(process)
    worker, beat = processes
    try:
        worker.start()
        beat.start()
        from celery import Celery

        client = Celery("tinyapp", broker=env["TINY_REDIS_URL"] + "/1",
                        backend=env["TINY_REDIS_URL"] + "/2", set_as_current=False)  # fmt: skip
        try:
            result = client.send_task("tinyapp.double", args=[21]).get(timeout=30)
        finally:
            client.close()
        assert result["n"] == 42
        assert result["fence"] >= 1
        assert result["module"].startswith(str(venv)), result["module"]
        ticks = redis.Redis.from_url(env["TINY_REDIS_URL"] + "/3")
        try:
            wait_for(lambda: int(ticks.get("ticks") or 0) >= 2, timeout=30,
                     message="two beat ticks run by the worker")  # fmt: skip
        finally:
            ticks.close()
        assert "elected leader" in beat.log_text()

        listed = subprocess.run(
            [*celery, "redlock", "ls", "--json"], cwd=app_dir, env=env, capture_output=True,
            text=True, check=False,
        )  # fmt: skip
        assert listed.returncode == 0, listed.stdout[-2000:] + listed.stderr[-3000:]
    finally:
        beat.stop()
        worker.stop()
    for process in processes:
        assert "Traceback" not in process.log_text(), process.log_tail(60)
