"""``HOST:PORT``: the one parser (``ncina.common.address``) behind every command and variable.

An address to bind (``ncina aggregator --listen``) may have port 0; an address to send to
(``ncina allreduce --aggregator``, ``ncina train --master``, ``--member``, ``--upstream``,
``$NCINA_AGGREGATOR``) may not. Each violation has one message. No test resolves a name but
``localhost`` (no DNS traffic).
"""

from __future__ import annotations

import argparse

import pytest

from ncina.common.address import bind_address, parse_address, peer_address


def test_an_address_parses_and_a_name_resolves_to_ipv4() -> None:
    assert parse_address("10.0.0.1:47000") == ("10.0.0.1", 47000)
    assert parse_address("localhost:5") == ("127.0.0.1", 5)
    assert parse_address("0.0.0.0:0") == ("0.0.0.0", 0)
    assert parse_address("10.0.0.1:65535", port_zero=False) == ("10.0.0.1", 65535)


@pytest.mark.parametrize(("text", "port_zero", "message"), [
    ("10.0.0.1", True, "'10.0.0.1' is not HOST:PORT"),
    (":5", True, "':5' is not HOST:PORT"),
    ("10.0.0.1:x", True, "'10.0.0.1:x': port 'x' is not a number"),
    ("10.0.0.1:", True, "'10.0.0.1:': port '' is not a number"),
    ("10.0.0.1:70000", True, "'10.0.0.1:70000': port 70000 is not in 0..65535"),
    ("10.0.0.1:-1", True, "'10.0.0.1:-1': port -1 is not in 0..65535"),
    ("10.0.0.1:0", False, "'10.0.0.1:0': port 0 is not in 1..65535"),
])  # fmt: skip
def test_each_violation_has_its_message(text: str, port_zero: bool, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_address(text, port_zero=port_zero)
    assert str(caught.value).startswith(message)


def test_the_argparse_types_bind_with_port_zero_and_send_without(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--listen", type=bind_address)
    parser.add_argument("--aggregator", type=peer_address)
    args = parser.parse_args(["--listen", "127.0.0.1:0", "--aggregator", "localhost:47000"])
    assert (args.listen, args.aggregator) == (("127.0.0.1", 0), ("127.0.0.1", 47000))
    with pytest.raises(SystemExit):
        parser.parse_args(["--aggregator", "127.0.0.1:0"])
    assert "argument --aggregator: '127.0.0.1:0': port 0 is not in 1..65535" in (
        capsys.readouterr().err
    )


def test_the_worker_command_and_the_torch_backend_use_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ncina.worker import cli as worker_cli

    commands = argparse.ArgumentParser(prog="ncina").add_subparsers()
    parser = worker_cli.add_parser(commands)
    with pytest.raises(SystemExit):
        parser.parse_args(["--aggregator", "10.0.0.1", "--job", "1", "--rank", "0",
                           "--workers", "1", "--input", "x", "--output", "y"])  # fmt: skip
    assert "argument --aggregator: '10.0.0.1' is not HOST:PORT" in capsys.readouterr().err
    pytest.importorskip("torch")
    from ncina.worker.torch_backend import NcinaOptions

    variable = "10.0.0.1:1,10.0.0.2:0"
    with pytest.raises(ValueError, match=rf"\$NCINA_AGGREGATOR='{variable}'.*port 0 is not in 1"):
        NcinaOptions.from_env({"NCINA_AGGREGATOR": variable})
