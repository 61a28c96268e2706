"""gcache.common.file_modes: the data dir and the auth file only their owner may read or
write (issue 21, findings 2 and 3). Real files in tmp dirs; no process."""

from __future__ import annotations

import os

import pytest

from gcache.common.file_modes import FileModeError, prepare_private_dir, secret_file_problems


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode_of(path) -> int:
    return os.stat(path).st_mode & 0o7777


def test_a_missing_data_dir_is_created_0700_whatever_the_umask(tmp_path, umask_022):
    path = tmp_path / "a" / "data"
    assert prepare_private_dir(str(path)) is True
    assert mode_of(path) == 0o700
    assert prepare_private_dir(str(path)) is False  # there now, and private: accepted


@pytest.mark.parametrize(
    ("mode", "others_can"), [(0o755, "read"), (0o770, "read and write"), (0o703, "write"), (0o740, "read")]
)
def test_a_data_dir_others_may_read_or_write_is_refused_with_the_chmod(tmp_path, mode, others_can):
    path = tmp_path / "data"
    path.mkdir()
    path.chmod(mode)
    with pytest.raises(FileModeError) as refused:
        prepare_private_dir(str(path))
    assert f"mode {mode:04o}" in str(refused.value)
    assert f"other users can {others_can} the cache's values" in str(refused.value)
    assert f"`chmod 700 {path}`" in str(refused.value)


def test_a_data_dir_others_may_only_traverse_is_accepted(tmp_path):
    path = tmp_path / "data"
    path.mkdir()
    path.chmod(0o711)
    assert prepare_private_dir(str(path)) is False


def auth_file(tmp_path, mode: int):
    path = tmp_path / "auth.toml"
    path.write_text("[tenants]\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640, 0o440])
def test_an_auth_file_only_owner_and_group_read_is_fine(tmp_path, mode):
    assert secret_file_problems(str(auth_file(tmp_path, mode))) == (None, None)


def test_a_world_readable_auth_file_is_a_warning(tmp_path):
    path = auth_file(tmp_path, 0o644)
    problems = secret_file_problems(str(path))
    assert problems.error is None
    assert problems.warning == f"--auth-file {path} is readable by every user: run `chmod 600 {path}`"


@pytest.mark.parametrize(("mode", "who"), [(0o620, "its group"), (0o602, "every user"), (0o666, "group and others")])
def test_a_group_or_world_writable_auth_file_is_refused(tmp_path, mode, who):
    path = auth_file(tmp_path, mode)
    problems = secret_file_problems(str(path))
    assert problems.error == (
        f"--auth-file {path} is mode {mode:04o}: writable by {who}, who could add a tenant; run `chmod 600 {path}`"
    )


def test_an_auth_file_of_another_non_root_user_is_refused(tmp_path):
    path = auth_file(tmp_path, 0o600)
    owner = os.stat(path).st_uid
    if owner == 0:  # tests run as root: pretend to be another user; root-owned stays accepted
        assert secret_file_problems(str(path), uid=4242) == (None, None)
        os.chown(path, 4243, -1)
        owner = 4243
    problems = secret_file_problems(str(path), uid=4242)
    assert problems.error.startswith(f"--auth-file {path} is owned by uid {owner}, neither this user (4242) nor root")
    assert f"`chown 4242 {path}`" in problems.error
