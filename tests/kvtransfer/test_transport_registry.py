"""The transports' table (pdserve/kvtransfer/transport/registry.py): every row builds a transport of its own name,
the configuration and the CLI offer exactly its names, and reading them imports neither torch nor NIXL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdserve.kvtransfer import config
from pdserve.kvtransfer.transport import registry
from pdserve.kvtransfer.transport.base import Transport


def test_every_row_resolves_to_a_transport_of_its_name():
    for name in registry.TRANSPORTS:
        cls = registry.transport_class(name)
        assert issubclass(cls, Transport) and cls.name == name


def test_the_configuration_offers_exactly_the_tables_transports():
    assert tuple(registry.TRANSPORTS) == config.TRANSPORTS


def test_reading_the_names_imports_neither_torch_nor_nixl():
    probe = (
        "import sys; import pdserve.cli; from pdserve.kvtransfer.config import TRANSPORTS; "
        "print(sorted(m for m in ('torch', 'nixl') if m in sys.modules))"
    )
    root = Path(__file__).parents[2]  # this checkout's pdserve, whatever is installed
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
