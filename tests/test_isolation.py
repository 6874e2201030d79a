"""The suite's isolation: servers started the way the tests start them keep their pidfiles in the run's temporary
dirs, and the user's own ninfer dirs (resolved from the HOME the run started with) gain no file."""
import json
import os
from pathlib import Path

from . import conftest


def test_every_home_and_ninfer_dir_is_a_temporary_one(tmp_path_factory):
    temporary = [p.resolve() for p in (conftest.SANDBOX["root"], tmp_path_factory.getbasetemp())]
    for name in conftest.PER_TEST_DIRS + conftest.RUN_CACHES:
        folder = Path(os.environ[name]).resolve()
        assert folder.is_dir() and any(folder.is_relative_to(t) for t in temporary), (name, folder)
    assert Path.home() != conftest.USER_HOME
    assert Path(os.environ["NINFER_MODELS_DIR"]).is_dir()  # the pulled models, read where they are


def test_a_server_fixture_leaves_nothing_in_the_users_dirs(api_server):
    pidfile = conftest.SANDBOX["run"] / "ninfer_state_dir" / "servers" / f"{api_server.proc.pid}.json"
    assert json.loads(pidfile.read_text())["port"] == api_server.port
    assert not (conftest.USER_DIRS["state"] / "servers" / pidfile.name).exists()
    assert conftest.leaked_files() == []
