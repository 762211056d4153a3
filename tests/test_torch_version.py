"""The oldest torch flce runs on, refused clearly below it."""

import pytest
import torch

from flce.torch_version import MIN_TORCH_VERSION, TORCH_VERSION, check_torch_version, release


@pytest.mark.parametrize(
    "version,expected",
    [("2.6.0", (2, 6)), ("2.4.1+cu121", (2, 4)), ("2.13.0+cpu", (2, 13)), ("2.8.0a0+gitabc", (2, 8))],
)
def test_release_of_a_version_string(version, expected):
    assert release(version) == expected


def test_the_installed_torch_is_supported():
    assert TORCH_VERSION == release(torch.__version__) >= MIN_TORCH_VERSION
    check_torch_version()


@pytest.mark.parametrize("version", ["2.4.1+cu121", "2.5.1"])
def test_an_older_torch_is_refused_naming_both_versions(version):
    with pytest.raises(ImportError, match=rf"flce needs torch>=2\.6; torch {version.replace('+', '[+]')} is installed"):
        check_torch_version(version)
