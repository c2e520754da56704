"""One tiny engine for every multi-turn test of the package (its
compilations are the slow part)."""

import pytest

from tests.agents import engine_setup


@pytest.fixture(scope='package')
def setup():
  return engine_setup.build()
