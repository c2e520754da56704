"""`python -m jaxcorr.dashboard`'s command line: several workdirs, and
this machine only unless `--host` says otherwise."""

from __future__ import annotations

import pytest

from jaxcorr.dashboard.__main__ import parse


def test_binds_localhost_and_takes_several_workdirs():
  args = parse(['--workdir', 'a', 'gs://b/run', '--workdir', 'c'])
  assert args.host == '127.0.0.1'
  assert args.workdir == ['a', 'gs://b/run', 'c']
  assert parse(['--workdir', 'a', '--host', '0.0.0.0']).host == '0.0.0.0'


@pytest.mark.parametrize(
  'argv, message',
  [
    ([], 'the following arguments are required: --workdir'),
    (['--workdir', 'a', '--port', '0'], '--port=0: 1..65535'),
    (['--workdir', 'a', '--poll', '0'], '--poll=0.0: a positive number'),
  ],
)
def test_bad_arguments_are_one_line(argv, message, capsys):
  with pytest.raises(SystemExit):
    parse(argv)
  assert message in capsys.readouterr().err
