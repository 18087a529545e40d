import os
import socket

from embcache.service.observability import mps


def test_control_pipe_found_in_the_pipe_directory(tmp_path):
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    with socket.socket(socket.AF_UNIX) as sock:  # what current drivers make
        sock.bind(str(tmp_path / "control"))
        assert mps.control_pipe(env) == tmp_path / "control"
    os.unlink(tmp_path / "control")
    os.mkfifo(tmp_path / "control")  # older drivers
    assert mps.control_pipe(env) == tmp_path / "control"


def test_no_control_daemon_no_pipe(tmp_path):
    assert mps.control_pipe({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}) is None
    (tmp_path / "control").write_text("")  # a plain file is not a control daemon's pipe
    assert mps.control_pipe({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}) is None
    assert mps.control_pipe({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "absent")}) is None
