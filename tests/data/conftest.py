"""The Criteo files several data test modules read (written once per module)."""

import pytest

from tests.data.criteo_files import write_multihot, write_tsv


@pytest.fixture(scope="module")
def tsv(tmp_path_factory):
    path = tmp_path_factory.mktemp("criteo") / "train.txt"
    samples, where = write_tsv(path)
    return path, samples, where


@pytest.fixture(scope="module")
def multihot(tmp_path_factory):
    directory = tmp_path_factory.mktemp("multihot")
    return directory, write_multihot(directory)
