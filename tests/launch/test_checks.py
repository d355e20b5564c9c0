"""launch/checks.py: the verdicts on facts that this machine cannot produce (RDMA devices,
CUDA GPUs, another host's versions); the doctor's own runs are tests/launch/test_doctor.py's."""

from launch.checks import backend_check, version_checks


def facts(**versions):
    base = {"python": "3.11.7", "mlx": "0.32.4", "backend": "Metal", "mlx_lm": "0.32.2", "package": "0.1.0",
            "macos": "26.2"}
    return {"versions": {**base, **versions}}


def test_a_version_mismatch_names_both_versions_and_rank_0s_host():
    checks = {c.name: c for c in version_checks(facts(macos="26.1", mlx_lm=None), facts(), "studio-1")}
    assert checks["macos"].status == "fail" and checks["macos"].detail == "macOS 26.1 here, 26.2 on studio-1 (rank 0)"
    assert checks["mlx_lm"].detail == "mlx-lm not installed here, 0.32.2 on studio-1 (rank 0)"
    assert checks["mlx_lm"].fix == "pip install mlx-lm==0.32.2"
    assert {c.status for n, c in checks.items() if n not in ("macos", "mlx_lm")} == {"pass"}


def test_jaccl_needs_the_hostfiles_rdma_devices_and_nccl_a_gpu():
    hosts = ["mac0", "mac1", "mac2"]
    rdma = [None, "rdma_en1", "rdma_en2"]
    missing = backend_check({"backend": {"rdma_devices": ["rdma_en1"]}}, "jaccl", rdma, hosts)
    assert missing.status == "fail" and missing.detail == "jaccl: RDMA devices rdma_en2 (to mac2) missing", missing
    assert backend_check({"backend": {"rdma_devices": ["rdma_en1", "rdma_en2"]}}, "jaccl", rdma, hosts).status == "pass"
    assert backend_check({"backend": {"rdma_devices": None}}, "jaccl-ring", rdma, hosts).status == "fail"
    assert backend_check({"backend": {"gpus": 0}}, "nccl", [], hosts).status == "fail"
