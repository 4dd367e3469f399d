"""The job description (``ncina.proto.job.JobSpec``): its defaults and default rules, one
message per violated rule, its one encoding (the handshake's descriptor), and its options."""

from __future__ import annotations

import argparse
from dataclasses import fields
from unittest import mock

import pytest
from ncina.proto.descriptor import DESCRIPTOR_SIZE, Descriptor, mismatches
from ncina.proto.header import HEADER, Format
from ncina.proto.job import DEFAULT_POOL_SIZE, DEFAULT_WINDOW_MAX, OPTIONS, JobSpec, default_k
from ncina.proto.nc8 import Window
from ncina.proto.profiles import LACKS, TOFINO_MAX_K, TOFINO_NC8_MAX_K, tofino_max_code
from ncina.proto.wire import DEFAULT_MTU, MAX_K

KEY = bytes(range(16))


def test_every_field_has_one_option() -> None:
    assert OPTIONS.keys() == {f.name for f in fields(JobSpec)}
    flags = [option.flag for option in OPTIONS.values()]
    assert len(set(flags)) == len(flags)


def test_defaults() -> None:
    spec = JobSpec(job=1, workers=4)
    assert (spec.pool_size, spec.window_max, spec.mtu) == (DEFAULT_POOL_SIZE, DEFAULT_WINDOW_MAX,
                                                           DEFAULT_MTU)  # fmt: skip
    assert (spec.result, spec.uplink, spec.key, spec.total_workers) == (
        Format.NC8, Format.NC8, None, None)  # fmt: skip
    assert spec.window == Window.for_job(4, 10)


@pytest.mark.parametrize(
    ("given", "k"),
    [
        ({}, 1456),  # 1500 - 20 IPv4 - 8 UDP - 16 header, one byte an element
        ({"key": KEY}, 1448),  # the 8-byte tag
        ({"result": "int"}, 182),  # 1456 // 8
        ({"mtu": 9000}, 8956),
        ({"mtu": 9216}, MAX_K),
        ({"uplink": "int", "total_workers": 8}, 182),  # a spine: int partial sums come up
        ({"total_workers": 8}, 182),  # under a leaf: int lanes, as the leaf's
        ({"total_workers": 4}, 1456),  # a one-level job said twice
        ({"k": 100}, 100),
    ],
)
def test_the_default_k_is_the_largest_that_fits_the_mtu(given: dict, k: int) -> None:
    assert JobSpec(job=1, workers=4, **given).k == k


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"job": 65536}, "job id must be in 0..65535, not 65536"),
        ({"job": None}, "job id is not given (0..65535)"),
        ({"workers": None, "total_workers": 8}, "workers is not given (1..64"),
        ({"workers": 0}, "workers must be in 1..64 (a worker bitmap is one 64-bit register word "
                         "in every backend), not 0"),
        ({"k": 0}, "k (elements per packet) must be in 1..9172, not 0"),
        ({"k": 9173, "mtu": 9216}, "k (elements per packet) must be in 1..9172, not 9173"),
        ({"pool_size": 65536}, "pool size must be in 1..65535, not 65536"),
        ({"mtu": 67}, "--mtu must be in 68..9216 (IPv4's minimum to a jumbo frame), not 67"),
        ({"total_workers": 3}, "total workers must be in 4..4096 (at least the 4 workers of "
                               "this aggregator), not 3"),
        ({"uplink": "int", "total_workers": 10},
         "a spine's 10 total workers must be a multiple of its 4 leaves (every leaf serves as "
         "many workers: their partial sums are bounded by it)"),
        ({"window_max": 200}, "no exponent window with e_max 200: no valid window for 4 workers "
                              "and e_max 200: window e_min 140 outside -126..63"),
        ({"result": "blob"}, "an INA job's result format is one of nc8, int, int32, not blob"),
        ({"uplink": Format.BLOB}, "an INA job's uplink format is one of nc8, int, not blob"),
        ({"key": b"short"}, "a job key has 16 to 64 bytes (32 to 128 hex digits), not 5"),
        ({"k": 1457}, "k=1457 nc8 elements take 1457 payload bytes, more than a datagram has at "
                      "MTU 1500; the largest k there is 1456"),
        ({"k": 183, "result": "int"}, "k=183 int elements take 1464 payload bytes, more than a "
                                      "datagram has at MTU 1500; the largest k there is 182"),
    ],
)  # fmt: skip
def test_each_violation_has_its_message(given: dict, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        JobSpec(**{"job": 1, "workers": 4, **given})
    lines = str(raised.value).split("\n  ")
    assert lines[0] == "invalid job:" and len(lines) == 2
    assert lines[1].startswith(message)


def test_every_violation_is_named_at_once() -> None:
    with pytest.raises(ValueError) as raised:
        JobSpec(job=-1, workers=65, k=0, pool_size=0, mtu=9217, result="x")
    assert str(raised.value).split("\n  ")[1:] == [
        "job id must be in 0..65535, not -1",
        "workers must be in 1..64 (a worker bitmap is one 64-bit register word in every "
        "backend), not 65",
        "k (elements per packet) must be in 1..9172, not 0",
        "pool size must be in 1..65535, not 0",
        "--mtu must be in 68..9216 (IPv4's minimum to a jumbo frame), not 9217",
        "an INA job's result format is one of nc8, int, int32, not x",
    ]


@pytest.mark.parametrize(
    "spec",
    [
        JobSpec(job=7, workers=4),
        JobSpec(job=65535, workers=64, k=100, pool_size=65535, window_max=20, result="int"),
        JobSpec(job=0, workers=1, key=KEY, mtu=9000),
        JobSpec(job=3, workers=30, result="int", window_max=40, profile="tofino"),
        JobSpec(job=3, workers=1, k=5, result="int", profile="tofino"),
    ],
)
def test_the_handshake_encoding_round_trips(spec: JobSpec) -> None:
    hello = spec.hello(rank=2)
    _, _, fmt, e_min, job, rank, _, count, _ = HEADER.unpack_from(hello)
    assert (fmt, e_min, job, rank, count) == (Format.JOB, spec.window.e_min, spec.job, 2, 1)
    payload = hello[HEADER.size:HEADER.size + DESCRIPTOR_SIZE]
    status, descriptor = Descriptor.unpack(payload)
    assert status == 0 and descriptor == spec.descriptor()
    assert descriptor.keyed == (spec.key is not None)
    assert JobSpec.from_descriptor(spec.job, descriptor, key=spec.key, mtu=spec.mtu) == spec


def test_a_hierarchical_job_decodes_to_the_same_descriptor() -> None:
    leaf = JobSpec(job=1, workers=4, total_workers=12)
    decoded = JobSpec.from_descriptor(1, leaf.descriptor())
    assert decoded.total_workers == 9  # the fewest total workers with a window of 12's span
    assert decoded.descriptor() == leaf.descriptor()
    spine = JobSpec(job=1, workers=4, total_workers=16, uplink="int")
    decoded = JobSpec.from_descriptor(1, spine.descriptor())
    assert decoded.total_workers == 12  # the fewest multiple of 4 leaves with that window
    assert decoded.descriptor() == spine.descriptor()
    leaf = JobSpec(job=1, workers=4, total_workers=12, result="int", k=8, profile="tofino")
    decoded = JobSpec.from_descriptor(1, leaf.descriptor())
    assert (decoded.total_workers, decoded.profile) == (9, "tofino")
    assert decoded.descriptor() == leaf.descriptor()


def test_a_descriptor_that_is_no_ina_job_is_refused() -> None:
    server = JobSpec(job=1, workers=2).descriptor()._replace(mode=int(Format.BLOB))
    with pytest.raises(ValueError, match="not an INA job's"):
        JobSpec.from_descriptor(1, server)
    keyed = JobSpec(job=1, workers=2, key=KEY).descriptor()
    with pytest.raises(ValueError, match="keyed: give its key"):
        JobSpec.from_descriptor(1, keyed)


def test_from_args_of_the_options_add_arguments_registers(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    JobSpec.add_arguments(parser, required=("job", "workers"))
    key_file = tmp_path / "key"
    key_file.write_text(KEY.hex())
    args = parser.parse_args(["--job", "3", "--workers", "5", "--k", "200", "--pool-size", "8",
                              "--window-max", "12", "--result", "int", "--total-workers", "10",
                              "--key-file", str(key_file), "--mtu", "9000"])  # fmt: skip
    spec = JobSpec.from_args(args)
    assert spec == JobSpec(job=3, workers=5, k=200, pool_size=8, window_max=12, result="int",
                           total_workers=10, key=KEY, mtu=9000)  # fmt: skip
    # to_args writes the same job back (the key travels as a file)
    again = parser.parse_args([*spec.to_args(), "--key-file", str(key_file)])
    assert JobSpec.from_args(again) == spec


def test_defaults_and_rules_appear_in_the_help() -> None:
    parser = argparse.ArgumentParser()
    actions = JobSpec.add_arguments(parser, "workers", "k", "pool_size", workers=4, k=256,
                                    rules={"pool_size": "from --bw"}, pool_size=None)  # fmt: skip
    assert set(actions) == {"workers", "k", "pool_size"}
    args = parser.parse_args([])
    assert (args.workers, args.k, args.pool_size) == (4, 256, None)
    assert JobSpec.from_args(args, job=1).k == 256
    assert JobSpec.from_args(args, job=1, k=None).k == default_k(DEFAULT_MTU, "nc8")
    help_text = " ".join(parser.format_help().split())
    assert "(default: 256)" in help_text and "(default: from --bw)" in help_text
    with pytest.raises(ValueError, match="not a job option: lanes"):
        JobSpec.add_arguments(argparse.ArgumentParser(), "lanes")


def test_a_bad_mtu_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    JobSpec.add_arguments(parser, "mtu")
    with pytest.raises(SystemExit):
        parser.parse_args(["--mtu", "9217"])
    assert "argument --mtu: --mtu must be in 68..9216" in capsys.readouterr().err


def test_the_tofino_profile_caps_the_codes_above_the_window_floor() -> None:
    """A tofino job keeps docs/protocol.md's e_min and takes codes up to 31 - ceil(log2 N),
    the twin's ``code_offset``: N workers' sums of +-2^(code - 1) fit a signed 32-bit lane."""
    for workers in (1, 2, 3, 4, 5, 16, 17, 30):
        spec = JobSpec(job=1, workers=workers, result="int", profile="tofino", window_max=20)
        full = Window.for_job(workers, 20)
        assert spec.window.e_min == full.e_min
        assert spec.window.max_code == tofino_max_code(workers) == 31 - (workers - 1).bit_length()
        top = spec.window.max_code - 1  # the largest code's integer: 2^top
        assert workers << top <= 1 << 30 < (2 * workers) << top  # the most that fits
        assert spec.k == TOFINO_MAX_K  # the design's lanes per pass, the default K under it


def test_the_tofino_profile_refuses_what_the_design_lacks_one_sentence_each() -> None:
    with pytest.raises(ValueError) as refused:
        JobSpec(job=9, workers=31, k=TOFINO_MAX_K + 1, key=KEY, profile="tofino")
    assert str(refused.value).splitlines()[1:] == [
        f"  job 9 has a key: {LACKS['tag']}",
        f"  job 9 has 31 workers: {LACKS['workers']}",
        f"  K={TOFINO_MAX_K + 1}: {LACKS['k']}",
    ]
    assert JobSpec(job=9, workers=30, result="int", k=12, profile="tofino").problems() == []
    assert JobSpec(job=9, workers=2, result="int", k=4, profile="tofino").problems() == []
    # int32 results: the profile's code cap is the int32 window's rule, one window in both
    # profiles (so its descriptor tells no profile: both aggregate alike)
    for workers in (2, 4, 30):
        tofino = JobSpec(job=9, workers=workers, result="int32", k=12, profile="tofino")
        plain = JobSpec(job=9, workers=workers, result="int32", k=12)
        assert tofino.window == plain.window and tofino.descriptor() == plain.descriptor()
        assert workers << tofino.window.max_code - 1 <= 1 << 30
    with pytest.raises(ValueError) as refused:
        JobSpec(job=9, workers=2, total_workers=4, uplink="int", result="int", k=4,
                profile="tofino")
    assert str(refused.value).splitlines()[1:] == [f"  job 9 sends int uplinks: {LACKS['uplinks']}"]
    with pytest.raises(ValueError, match="profile is one of default, tofino, not x"):
        JobSpec(job=9, workers=2, profile="x")


def test_a_profile_mismatch_is_named() -> None:
    """The descriptor's window tells the profile: a worker and an aggregator that differ in it
    are refused naming the profile, not the window that follows from it."""
    tofino = JobSpec(job=1, workers=4, k=12, result="int", profile="tofino").descriptor()
    default = JobSpec(job=1, workers=4, k=12, result="int").descriptor()
    assert mismatches(tofino, default) == [("profile", "tofino", "default")]
    assert mismatches(default, tofino) == [("profile", "default", "tofino")]
    assert mismatches(tofino, tofino) == []
    other = JobSpec(job=1, workers=4, k=12, result="int", profile="tofino", window_max=11)
    assert mismatches(tofino, other.descriptor()) == [("window e_max", "-22", "-21")]


def test_every_field_is_an_option_of_ncina_aggregator() -> None:
    """The benchmarks and the topology give their aggregators every field of the job that the
    aggregator's role has (``JobSpec.to_args(role="aggregator")``), so ``ncina aggregator``
    must take each one, and read it back as the same job."""
    from ncina.aggregator import cli as aggregator_cli

    parser = argparse.ArgumentParser()
    aggregator_cli.add_parser(parser.add_subparsers())
    spec = JobSpec(job=3, workers=4, k=12, pool_size=8, window_max=9, result="int", mtu=9000,
                   profile="tofino")  # fmt: skip
    args = parser.parse_args(["aggregator", *spec.to_args(role="aggregator")])
    assert JobSpec.from_args(args) == spec


def test_the_tofino_profile_re_compresses_nc8_results_for_at_most_7_lanes() -> None:
    """The build with NC8 results fits 7 lanes (``TOFINO_NC8_MAX_K``): a nc8 job of 8 is refused
    with the design's sentence by ``JobSpec``, ``JobConfig`` and the twin's control plane, one
    of 7 runs, int and int32 results keep TOFINO_MAX_K (32); a nc8 job's default K under the
    profile is 7."""
    from ncina.aggregator.backends.tofino.twin import limits
    from ncina.aggregator.jobs import JobConfig

    with pytest.raises(ValueError) as refused:
        JobSpec(job=9, workers=4, result="nc8", k=8, profile="tofino")
    assert str(refused.value).splitlines()[1:] == [f"  K=8 with nc8 results: {LACKS['nc8_k']}"]
    assert JobSpec(job=9, workers=4, result="nc8", k=7, profile="tofino").problems() == []
    assert JobSpec(job=9, workers=4, result="nc8", profile="tofino").k == TOFINO_NC8_MAX_K == 7
    for result in ("int", "int32"):
        assert JobSpec(job=9, workers=4, result=result, k=TOFINO_MAX_K,
                       profile="tofino").problems() == []  # fmt: skip
        assert JobSpec(job=9, workers=4, result=result, profile="tofino").k == TOFINO_MAX_K
    assert JobSpec(job=9, workers=4, result="nc8", k=12).problems() == []  # default profile
    with pytest.raises(ValueError) as refused:
        JobConfig.create(job=9, workers=4, k=8, result_format="nc8", profile="tofino")
    assert str(refused.value).endswith(f": K=8 with nc8 results: {LACKS['nc8_k']}")
    config = JobConfig.create(job=9, workers=4, k=7, result_format="nc8", profile="tofino")
    assert limits.refusal(config, 7) is None
    assert limits.refusal(config, 8) == f"K=8 with nc8 results: {LACKS['nc8_k']}"


@pytest.mark.parametrize(
    "given",
    [{}, {"key": KEY}, {"result": "int"}, {"mtu": 9000}, {"total_workers": 8},
     {"result": "int32", "profile": "tofino"}, {"result": "nc8", "profile": "tofino"}],
)  # fmt: skip
def test_the_client_takes_the_jobs_default_k(given: dict) -> None:
    """One default-K rule (``default_k``): a client given no K takes the K its job's
    ``JobSpec`` has (int lanes under a leaf, the design's lanes under the tofino profile)."""
    from ncina.worker.client import AllreduceClient

    client_keywords = {"result_format" if name == "result" else name: value
                       for name, value in given.items()}  # fmt: skip
    with AllreduceClient(("127.0.0.1", 9), job=1, rank=0, workers=4, handshake_timeout=None,
                         **client_keywords) as client:  # fmt: skip
        assert client.k == JobSpec(job=1, workers=4, **given).k


def test_restart_retries_are_the_jobs_and_reach_its_clients() -> None:
    """Every rank of a job must recover from the same aggregator restarts: a field of the job
    (a worker's, not the aggregator's), checked, carried by ``AllreduceClient.for_job``."""
    from ncina.proto.job import role_fields
    from ncina.worker.client import AllreduceClient

    with AllreduceClient.for_job(("127.0.0.1", 9), JobSpec(job=1, workers=2, restart_retries=0),
                                 rank=0, handshake_timeout=None) as client:  # fmt: skip
        assert client.restart_retries == 0
    assert JobSpec(job=1, workers=2).restart_retries == 3
    with pytest.raises(ValueError, match=r"restart retries must be in 0\.\.1000, not -1"):
        JobSpec(job=1, workers=2, restart_retries=-1)
    assert "restart_retries" in role_fields("worker")
    assert "restart_retries" not in role_fields("aggregator")


def test_a_role_registers_the_fields_a_command_has_not_placed() -> None:
    """``add_arguments(role=...)`` adds the role's fields that a command has not placed (with
    its own defaults) and does not lack; ``to_args(role=...)`` writes the same fields back."""
    from ncina.proto.job import role_fields

    parser = argparse.ArgumentParser()
    JobSpec.add_arguments(parser, "k", k=256)
    added = JobSpec.add_arguments(parser, role="worker", lacks=("total_workers",))
    assert set(added) == set(role_fields("worker")) - {"k", "total_workers"}
    assert parser.parse_args([]).k == 256
    assert JobSpec.add_arguments(parser, role="worker") == {"total_workers": mock.ANY}
    with pytest.raises(ValueError, match="not a field left to the role: k"):
        JobSpec.add_arguments(parser, role="worker", k=3)
    with pytest.raises(ValueError, match="a command's role is one of aggregator, worker, run"):
        role_fields("switch")
    spine = JobSpec(job=1, workers=2, uplink="int", total_workers=4)
    assert "--uplink" in spine.to_args(role="aggregator")
    assert "--uplink" not in spine.to_args(role="worker")
    assert "--total-workers" not in spine.to_args(role="worker", lacks=("total_workers",))
