"""Multi-node hosts checked before start and the variables ssh carries (issue 32, items 5 and 7).

``optima/training/hosts.py`` (resolution, loopback, the driver on the first host), ``ssh -G`` through a stand-in,
the allocation's refusal of a loopback name beside other nodes, and ``optima/training/nodes.py``'s allow-list. Fast: no
real ssh, no DNS beyond this machine's own names.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from optima.config import RecipeError, SFTRecipe, load_recipe
from optima.hardware.allocation import allocate_hardware
from optima.hardware.machine import parse_hardware
from optima.training.hosts import Resolver, check_hosts, is_local, verify_hosts
from optima.training.nodes import FORWARDED_ENV, forwarded_env, ssh_destination
from tests.test_nodes import fake_ssh, run_nodes

REPO = Path(__file__).resolve().parent.parent
ADDRESSES = {
    "node1": ["10.0.0.1"],
    "node2": ["10.0.0.2"],
    "ubuntu-host": ["127.0.1.1"],  # Ubuntu maps the machine's own hostname to 127.0.1.1 in /etc/hosts
    "localhost": ["127.0.0.1", "::1"],
    "127.0.0.1": ["127.0.0.1"],
}
SSH_CONFIG = {"alias1": "node1", "bob@node1": "node1", "bob@alias1": "node1"}


def resolver(local: tuple[str, ...] = ("10.0.0.1",)) -> Resolver:
    return Resolver(
        destination=lambda host: SSH_CONFIG.get(host, host),
        addresses=lambda name: ADDRESSES.get(name, []),
        local=lambda address: address in local,
    )


def test_the_main_address_comes_from_ssh_config_and_dns():
    """``user@host`` and aliases broke ``--main_process_ip``; now it is the first host's resolved address."""
    assert check_hosts(["bob@alias1", "node2"], resolver()) == ("10.0.0.1", [])
    assert verify_hosts(["alias1", "node2"], resolver()) == "10.0.0.1"


@pytest.mark.parametrize(
    ("hosts", "local", "message"),
    [
        (["localhost", "node2"], (), "train_hosts[0] 'localhost' resolves to 127.0.0.1, a loopback address"),
        (["ubuntu-host", "node2"], (), "resolves to 127.0.1.1, a loopback address"),
        (["node2", "node1"], ("10.0.0.1",), "train_hosts[0] 'node2' resolves to 10.0.0.2, not an address of this"),
        (["node1", "gone"], ("10.0.0.1",), "train_hosts[1] 'gone' does not resolve on the driver"),
        (["node1", "localhost"], ("10.0.0.1",), "train_hosts[1] 'localhost' resolves to 127.0.0.1, a loopback"),
    ],
)
def test_bad_hosts_are_refused_before_start(hosts, local, message):
    main, problems = check_hosts(hosts, resolver(local))
    assert main is None and any(message in p for p in problems), problems
    with pytest.raises(RecipeError, match="train_hosts"):
        verify_hosts(hosts, resolver(local))


def test_every_problem_is_named():
    _, problems = check_hosts(["node2", "gone"], resolver())
    assert len(problems) == 2


def test_hosts_all_on_the_loopback_are_one_machines_rehearsal():
    assert check_hosts(["127.0.0.1", "localhost"], resolver()) == ("127.0.0.1", [])


def test_is_local_binds_only_this_machines_addresses():
    assert is_local("127.0.0.1") and not is_local("192.0.2.1")  # TEST-NET-1: never assigned to a machine


def test_ssh_destination_reads_ssh_dash_g(tmp_path):
    stub = tmp_path / "ssh"
    stub.write_text(
        f"#!{sys.executable}\nimport sys\nassert sys.argv[1] == '-G'\n"
        "print('user bob'); print('hostname real-node-1.cluster'); print('port 22')\n"
    )
    stub.chmod(0o755)
    assert ssh_destination("bob@alias", str(stub)) == "real-node-1.cluster"
    assert ssh_destination("bob@10.0.0.9", str(stub)) == "10.0.0.9"  # an address is not looked up
    assert ssh_destination("bob@plain", str(tmp_path / "missing-ssh")) == "plain"  # no ssh: the host after user@


def test_the_allocation_refuses_a_loopback_name_beside_other_nodes(monkeypatch):
    """``train_hosts: [localhost, node2]`` planned as feasible and node 2 waited on its own loopback."""
    monkeypatch.chdir(REPO)
    recipe = load_recipe(
        SFTRecipe, REPO / "train/sft_recipes/arc.yaml", {"train_hosts": ["localhost", "node2"]}, check_paths=False
    )
    allocation = allocate_hardware(recipe, parse_hardware("2x8x80GB"), [0])
    assert any("'localhost' is a loopback name beside other nodes" in p for p in allocation.problems)


def test_the_launcher_refuses_unresolvable_hosts_before_any_ssh(tmp_path):
    result = run_nodes(tmp_path, "127.0.0.1,no-such-host.invalid", [sys.executable, "-c", "print('started')"])
    assert result.returncode == 2 and "started" not in result.stdout
    assert "train_hosts[1] 'no-such-host.invalid' does not resolve" in result.stderr


def test_the_allow_list_carries_the_interconnect_and_cuda_variables():
    environ = {
        "NCCL_IB_HCA": "mlx5",
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_DEVICE_RDMA": "1",
        "UCX_TLS": "rc",
        "GLOO_SOCKET_IFNAME": "eth0",
        "CUDA_HOME": "/usr/local/cuda",
        "PATH": "/usr/local/cuda/bin:/usr/bin",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "HF_HOME": "/h",
        "SECRET_TOKEN": "no",
        "HOME": "/root",
    }
    carried = forwarded_env(environ, "0,1")
    assert carried == {k: v for k, v in environ.items() if k not in ("SECRET_TOKEN", "HOME")} | {
        "CUDA_VISIBLE_DEVICES": "0,1"
    }
    assert forwarded_env(environ, "", ["NCCL_*", "HOME"]) == {"NCCL_IB_HCA": "mlx5", "HOME": "/root"}
    assert "PATH" in FORWARDED_ENV and "FI_*" in FORWARDED_ENV


def test_the_recipe_replaces_the_allow_list(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    values = {"train_hosts": ["node1", "node2"], "train_forward_env": ["NCCL_*", "MY_VAR"]}
    recipe = load_recipe(SFTRecipe, REPO / "train/sft_recipes/arc.yaml", values, check_paths=False)
    allocation = allocate_hardware(recipe, parse_hardware("2x8x80GB"), [0])
    wrapped = allocation.training.wrap(["/py"], ["accelerate"])
    assert wrapped[wrapped.index("--forward") + 1] == "NCCL_*,MY_VAR"
    report = "import os; print(os.environ.get('OPTIMA_MARK'), os.environ.get('SECRET_TOKEN'))"
    argv = [sys.executable, "-m", "optima.training.nodes", "--launcher", "ssh", "--hosts", "127.0.0.1,127.0.0.1"]
    argv += ["--executable", str(fake_ssh(tmp_path)), "--forward", "SECRET_*", "--", sys.executable, "-c", report]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OPTIMA_MARK": "x", "SECRET_TOKEN": "no"}
    result = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["None no", "None no"]  # only what the recipe names travels
