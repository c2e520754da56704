"""The embedded arithmetic task, the file sources and the prompt loader."""

from __future__ import annotations

import itertools
import json

import pytest

from configs import trainer as trainer_configs
from jaxcorr.data import prompt_check, tasks
from jaxcorr.data import prompts as data
from jaxcorr.data.tasks import Example

# -- tokenizer ---------------------------------------------------------------


def test_tokenizer_round_trip_and_specials():
  tok = tasks.CharTokenizer()
  assert tok.vocab_size <= 32
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.stop_ids == (tok.eos_id,)
  text = tok.characters
  ids = tok.encode(text)
  assert ids[0] == tok.bos_id
  assert len(set(ids)) == len(ids) == len(text) + 1
  assert max(ids) == tok.vocab_size - 1
  assert tok.decode(ids) == text
  assert tok.encode('1+2=', bos=False, eos=True)[-1] == tok.eos_id
  assert tok.encode('1+2=', bos=False)[0] != tok.bos_id


def test_tokenizer_decode_stops_at_eos_and_skips_pad_bos():
  tok = tasks.CharTokenizer()
  ids = [tok.pad_id, tok.bos_id, *tok.encode('42', bos=False), tok.pad_id]
  ids += [tok.eos_id, *tok.encode('7', bos=False)]
  assert tok.decode(ids) == '42'
  # An id the tokenizer lacks (a 32-row embedding) can never match an answer.
  assert tok.decode([*tok.encode('4', bos=False), 31]) == '4\ufffd'


def test_tokenizer_unknown_character():
  with pytest.raises(ValueError, match=r"character 'x' at position 2"):
    tasks.CharTokenizer().encode('12x')


# -- arithmetic task ---------------------------------------------------------


def test_arithmetic_is_a_function_of_seed_and_index():
  kw = dict(max_operand=99, ops='+-*')
  forward = [tasks.arithmetic_example(3, i, **kw) for i in range(50)]
  backward = [tasks.arithmetic_example(3, i, **kw) for i in reversed(range(50))]
  assert forward == backward[::-1]
  assert list(tasks.ArithmeticSource(50, 3, 99, '+-*')) == forward
  other = [tasks.arithmetic_example(4, i, **kw) for i in range(50)]
  assert sum(a != b for a, b in zip(forward, other)) > 40
  assert len({e.prompt for e in forward}) > 40


def test_arithmetic_answers_are_correct():
  src = tasks.ArithmeticSource(300, 0, 20, '+-*')
  seen_ops, negative = set(), False
  for ex in src:
    assert ex.prompt.endswith('=')
    expr = ex.prompt[:-1]
    op = next(c for c in expr if c in '+-*')
    a, b = (int(x) for x in expr.split(op))
    assert 0 <= a <= 20 and 0 <= b <= 20
    assert ex.answer == str({'+': a + b, '-': a - b, '*': a * b}[op])
    seen_ops.add(op)
    negative |= ex.answer.startswith('-')
    tasks.CharTokenizer().encode(ex.prompt + ex.answer)
  assert seen_ops == {'+', '-', '*'}
  assert negative
  assert {e.prompt[-2] for e in tasks.ArithmeticSource(50, 0, 9)} <= set(
    '0123456789'
  )
  assert all('+' in e.prompt for e in tasks.ArithmeticSource(50, 0, 9))


def test_arithmetic_source_sequence_and_validation():
  src = tasks.ArithmeticSource(5, 1, 9)
  assert len(src) == 5
  assert src[-1] == src[4]
  assert src[1:3] == [src[1], src[2]]
  with pytest.raises(IndexError):
    src[5]
  for kwargs, field in (
    (dict(num_examples=0), 'config.data.num_examples'),
    (dict(seed=-1), 'config.data.seed'),
    (dict(max_operand=0), 'config.data.max_operand'),
    (dict(ops='+/'), 'config.data.ops'),
    (dict(ops=''), 'config.data.ops'),
  ):
    args = dict(num_examples=5, seed=0, max_operand=9, ops='+') | kwargs
    with pytest.raises(ValueError, match=field):
      tasks.ArithmeticSource(**args)
  with pytest.raises(ValueError, match='index'):
    tasks.arithmetic_example(0, -1, max_operand=9)


# -- file sources ------------------------------------------------------------

GSM8K_ROWS = [
  {
    'question': 'Natalia sold clips to 48 of her friends...',
    'answer': 'Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72',
  },
  {'question': 'How many?', 'answer': 'Lots.\n#### 1,234'},
  {'question': 'Negative?', 'answer': 'It is #### -5 '},
]


def _write_jsonl(path, rows, blank_line=False):
  lines = [json.dumps(r) for r in rows]
  if blank_line:
    lines.insert(1, '   ')
  path.write_text('\n'.join(lines) + '\n')
  return path


def _write_parquet(path, columns):
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.table(columns), path)
  return path


def test_jsonl_gsm8k_layout(tmp_path):
  path = _write_jsonl(tmp_path / 'train.jsonl', GSM8K_ROWS, blank_line=True)
  src = data.JsonlSource(path)
  assert len(src) == 3
  assert src[0] == Example(GSM8K_ROWS[0]['question'], '72')
  assert [e.answer for e in src] == ['72', '1234', '-5']
  raw = data.JsonlSource(str(path), answer_format='raw')
  assert raw[1].answer == 'Lots.\n#### 1,234'


def test_jsonl_other_fields_and_numeric_answers(tmp_path):
  rows = [{'problem': '1+1', 'solution': 2}, {'problem': '2+2', 'solution': 4}]
  path = _write_jsonl(tmp_path / 'x.jsonl', rows)
  src = data.JsonlSource(
    path, prompt_field='problem', answer_field='solution', answer_format='raw'
  )
  assert list(src) == [Example('1+1', '2'), Example('2+2', '4')]


def test_jsonl_errors(tmp_path):
  rows = [GSM8K_ROWS[0], {'query': 'q', 'answer': '#### 1'}]
  path = _write_jsonl(tmp_path / 'bad.jsonl', rows)
  with pytest.raises(
    ValueError, match=r"line 2: missing field 'question'"
  ) as e:
    data.JsonlSource(path)
  assert "available fields: 'query', 'answer'" in str(e.value)
  assert 'config.data.prompt_field' in str(e.value)
  path = _write_jsonl(tmp_path / 'noanswer.jsonl', [{'question': 'q'}])
  with pytest.raises(ValueError, match=r'config.data.answer_field'):
    data.JsonlSource(path)
  path = _write_jsonl(
    tmp_path / 'nomark.jsonl', [{'question': 'q', 'answer': '7'}]
  )
  with pytest.raises(ValueError, match=r"line 1: .*no '####'.*'raw'"):
    data.JsonlSource(path)
  bad = tmp_path / 'broken.jsonl'
  bad.write_text(json.dumps(GSM8K_ROWS[0]) + '\n{not json\n')
  with pytest.raises(ValueError, match='line 2: invalid JSON'):
    data.JsonlSource(bad)
  empty = tmp_path / 'empty.jsonl'
  empty.write_text('\n')
  with pytest.raises(ValueError, match='holds no examples'):
    data.JsonlSource(empty)
  with pytest.raises(ValueError, match=r'config.data.path: .*does not exist'):
    data.JsonlSource(tmp_path / 'missing.jsonl')
  with pytest.raises(ValueError, match=r'config.data.answer_format'):
    data.JsonlSource(path, answer_format='boxed')


def test_parquet_gsm8k_layout_and_errors(tmp_path):
  columns = {
    'question': [r['question'] for r in GSM8K_ROWS],
    'answer': [r['answer'] for r in GSM8K_ROWS],
    'extra': [1, 2, 3],
  }
  path = _write_parquet(tmp_path / 'train.parquet', columns)
  src = data.ParquetSource(path)
  assert [e.answer for e in src] == ['72', '1234', '-5']
  assert src[2].prompt == 'Negative?'
  with pytest.raises(ValueError, match=r"missing field 'prompt'") as e:
    data.ParquetSource(path, prompt_field='prompt')
  assert "available fields: 'question', 'answer', 'extra'" in str(e.value)
  columns['answer'][1] = None
  path = _write_parquet(tmp_path / 'null.parquet', columns)
  with pytest.raises(ValueError, match='row 1: answer field'):
    data.ParquetSource(path)


def test_make_source_from_config(tmp_path):
  cfg = trainer_configs.sections()['data']
  cfg.num_examples, cfg.seed, cfg.ops = 7, 5, '+-'
  src = data.make_source(cfg)
  assert list(src) == list(tasks.ArithmeticSource(7, 5, 99, '+-'))
  evals = data.make_eval_source(cfg)
  assert list(evals) == list(tasks.ArithmeticSource(256, 6, 99, '+-'))
  cfg.eval_examples = 0
  assert data.make_eval_source(cfg) is None

  path = _write_jsonl(tmp_path / 'train.jsonl', GSM8K_ROWS)
  plain = {'source': 'jsonl', 'path': str(path)}
  assert [e.answer for e in data.make_source(plain)] == ['72', '1234', '-5']
  assert data.make_eval_source(plain) is None
  plain['eval_path'] = str(path)
  assert len(data.make_eval_source(plain)) == 3

  with pytest.raises(ValueError, match=r'config.data.source') as e:
    data.make_source({'source': 'hf_hub'})
  assert "'arithmetic', 'jsonl', 'parquet'" in str(e.value)
  with pytest.raises(ValueError, match=r'config.data.path'):
    data.make_source({'source': 'parquet', 'path': ''})


def test_format_prompt():
  ex = Example('17+25=', '42')
  assert data.format_prompt('{prompt}', ex) == '17+25='
  assert data.format_prompt('Q: {prompt}\nA:', ex) == 'Q: 17+25=\nA:'
  assert data.format_prompt(r'{prompt} \boxed{{}}', ex) == r'17+25= \boxed{}'
  with pytest.raises(ValueError, match=r'config.data.prompt_template'):
    data.format_prompt('Q: {question}', ex)
  with pytest.raises(ValueError, match=r"literal braces as '\{\{'"):
    data.format_prompt(r'{prompt} \boxed{}', ex)


# -- prompt loader -----------------------------------------------------------


def _numbered(n):
  return [Example(str(i), str(i)) for i in range(n)]


def _ids(batch):
  return [int(e.prompt) for e in batch]


@pytest.mark.parametrize(('n', 'batch_size'), [(12, 4), (7, 3), (5, 8)])
def test_loader_covers_every_example_once_per_epoch(n, batch_size):
  loader = data.PromptLoader(_numbered(n), batch_size=batch_size, seed=1)
  stream = []
  while len(stream) < 4 * n:
    stream += _ids(loader.next_batch())
  epochs = [stream[e * n : (e + 1) * n] for e in range(4)]
  for order in epochs:
    assert sorted(order) == list(range(n))
  assert len({tuple(o) for o in epochs}) > 1  # reshuffled every epoch
  assert loader.epoch == len(stream) // n


def test_loader_shuffle_off_and_seeds():
  plain = data.PromptLoader(_numbered(6), batch_size=4, seed=0, shuffle=False)
  assert _ids(plain.next_batch()) + _ids(plain.next_batch()) == [
    0, 1, 2, 3, 4, 5, 0, 1,
  ]  # fmt: skip
  a = data.PromptLoader(_numbered(50), batch_size=10, seed=0)
  b = data.PromptLoader(_numbered(50), batch_size=10, seed=0)
  c = data.PromptLoader(_numbered(50), batch_size=10, seed=1)
  first = _ids(a.next_batch())
  assert first == _ids(b.next_batch())
  assert first != _ids(c.next_batch())
  assert first != list(range(10))


def test_loader_resume_is_exact():
  src = tasks.ArithmeticSource(23, 0, 99)
  reference = data.PromptLoader(src, batch_size=6, seed=3)
  expected = [reference.next_batch() for _ in range(12)]
  first = data.PromptLoader(src, batch_size=6, seed=3)
  for _ in range(7):
    first.next_batch()
  state = json.loads(json.dumps(first.state()))
  assert state['position'] == 42
  resumed = data.PromptLoader(src, batch_size=6, seed=3)
  resumed.restore(state)
  assert [resumed.next_batch() for _ in range(5)] == expected[7:]
  assert resumed.state() == reference.state()


def test_loader_restore_rejects_another_stream():
  loader = data.PromptLoader(_numbered(10), batch_size=2, seed=0)
  state = loader.state()
  other = data.PromptLoader(_numbered(10), batch_size=2, seed=1)
  with pytest.raises(ValueError, match='seed'):
    other.restore(state)
  with pytest.raises(ValueError, match='num_examples'):
    loader.restore({**state, 'num_examples': 0})
  with pytest.raises(ValueError, match='position'):
    loader.restore({'position': -1})


@pytest.mark.parametrize('n', [16, 13])
def test_loader_process_shares(n):
  src = _numbered(n)
  single = data.PromptLoader(src, batch_size=8, seed=2)
  shards = [
    data.PromptLoader(
      src, batch_size=8, seed=2, process_index=i, process_count=4
    )
    for i in range(4)
  ]
  for _ in range(5):
    parts = [_ids(s.next_batch()) for s in shards]
    assert all(len(p) == 2 for p in parts)
    union = list(itertools.chain(*parts))
    assert union == _ids(single.next_batch())
    if n % 8 == 0:  # batches within one epoch: disjoint examples
      assert len(set(union)) == 8
  assert {s.state()['position'] for s in shards} == {single.position}


def test_loader_validation():
  src = _numbered(4)
  with pytest.raises(ValueError, match='multiple of process_count'):
    data.PromptLoader(src, batch_size=6, seed=0, process_count=4)
  with pytest.raises(ValueError, match='process_index'):
    data.PromptLoader(
      src, batch_size=4, seed=0, process_index=2, process_count=2
    )
  with pytest.raises(ValueError, match='batch_size'):
    data.PromptLoader(src, batch_size=0, seed=0)
  with pytest.raises(ValueError, match='no examples'):
    data.PromptLoader([], batch_size=1, seed=0)


def test_loader_resumes_after_a_row_is_removed(caplog):
  """A bad row removed from the file between runs: the saved state resumes
  at the same epoch and fraction of it (before, the run could not resume:
  the state pinned num_examples)."""
  saved = data.PromptLoader(_numbered(10), batch_size=2, seed=0)
  for _ in range(12):  # position 24: epoch 2, 40% through it
    saved.next_batch()
  shorter = data.PromptLoader(_numbered(9), batch_size=2, seed=0)
  shorter.restore(saved.state())
  assert shorter.position == 2 * 9 + 3
  assert shorter.epoch == 2
  assert 'continuing at epoch 2, 40.0% through it' in caplog.text
  assert len(shorter.next_batch()) == 2


def _jsonl(path, lines: list[bytes]) -> str:
  path.write_bytes(b'\n'.join(lines) + b'\n')
  return str(path)


def test_jsonl_bytes_that_are_not_utf8_name_the_line(tmp_path):
  path = _jsonl(
    tmp_path / 'd.jsonl',
    [
      b'{"question": "1+1=", "answer": "2"}',
      b'',
      b'{"question": "caf\xe9", "answer": "3"}',
    ],
  )
  with pytest.raises(
    ValueError, match=r"d.jsonl' line 3: not UTF-8 \(byte 0xe9 at column 18"
  ):
    data.JsonlSource(path, answer_format='raw')


def test_every_prompt_is_checked_at_start_up_with_file_and_line(tmp_path):
  long = '9' * 20
  path = _jsonl(
    tmp_path / 'd.jsonl',
    [
      b'{"question": "1+1=", "answer": "2"}',
      f'{{"question": "{long}+1=", "answer": "0"}}'.encode(),
      b'{"question": "2+2=", "answer": "4"}',
      b'{"question": "x+2=", "answer": "4"}',
    ],
  )
  src = data.JsonlSource(path, answer_format='raw')
  assert src.where(1) == f'JSONL file {path!r} line 2'
  tok = tasks.CharTokenizer()
  kw = dict(template='Q: {prompt}', max_prompt_length=12)
  with pytest.raises(ValueError) as info:
    prompt_check.check_prompts(src, tok.encode, **kw)
  msg = str(info.value)
  assert msg.startswith('2 prompt(s) cannot be used: 1 longer than ')
  assert 'config.rollout.max_prompt_length=12' in msg
  assert f'{path!r} line 2: 27 tokens; raise the limit' in msg
  assert f"{path!r} line 4: CharTokenizer cannot encode character 'x'" in msg
  prompt_check.check_prompts(
    src[:1] + src[2:3], tok.encode, template='{prompt}', max_prompt_length=5
  )


def test_arithmetic_prompts_are_bounded_by_the_longest():
  src = tasks.ArithmeticSource(100_000, 0, max_operand=999, ops='+-')
  tok = tasks.CharTokenizer()
  # '999+999=' is 8 characters + BOS.
  prompt_check.check_prompts(
    src, tok.encode, template='{prompt}', max_prompt_length=9
  )
  with pytest.raises(ValueError, match=r"'999-999=' |longest"):
    prompt_check.check_prompts(
      src, tok.encode, template='{prompt}', max_prompt_length=8
    )
  longest = max(len(tok.encode(src[i].prompt)) for i in range(0, 100_000, 997))
  assert longest <= 9


def test_empty_prompts_are_refused_and_empty_answers_warned(tmp_path, caplog):
  """An empty prompt or answer used to be accepted silently: the prompt is
  now a start-up error naming file and line, the answer a warning naming
  the lines (a reward may not need it)."""
  rows = [
    {'question': 'q1', 'answer': '1'},
    {'question': ' \n', 'answer': '2'},
  ]
  path = _write_jsonl(tmp_path / 'p.jsonl', rows)
  with pytest.raises(
    ValueError, match=r"p\.jsonl' line 2: prompt field 'question' is empty"
  ):
    data.JsonlSource(path, answer_format='raw')
  columns = {'question': ['q1', ''], 'answer': ['1', '2']}
  path = _write_parquet(tmp_path / 'p.parquet', columns)
  with pytest.raises(ValueError, match=r'row 1: prompt field .* is empty'):
    data.ParquetSource(path, answer_format='raw')

  kw = dict(template='{prompt}', max_prompt_length=64)
  encode = tasks.CharTokenizer().encode
  rows = [{'question': f'{i}', 'answer': a} for i, a in enumerate('1 ' + '3')]
  path = _write_jsonl(tmp_path / 'a.jsonl', rows)
  src = data.JsonlSource(path, answer_format='raw')
  assert len(src) == 3
  with caplog.at_level('WARNING'):
    prompt_check.check_prompts(src, encode, **kw)
  assert '1 of 3 examples have an empty answer: JSONL file' in caplog.text
  assert "a.jsonl' line 2. exact_match" in caplog.text
  caplog.clear()
  columns = {'question': ['1', '2'], 'answer': ['', '']}
  src = data.ParquetSource(
    _write_parquet(tmp_path / 'a.parquet', columns), answer_format='raw'
  )
  with caplog.at_level('WARNING'):
    prompt_check.check_prompts(src, encode, **kw)
  assert '2 of 2 examples have an empty answer: Parquet file' in caplog.text
  assert "a.parquet' row 0; Parquet file" in caplog.text
  caplog.clear()
  src = data.JsonlSource(
    _write_jsonl(tmp_path / 'ok.jsonl', [{'question': '1', 'answer': '#### 2'}])
  )
  with caplog.at_level('WARNING'):
    prompt_check.check_prompts(src, encode, **kw)
    prompt_check.check_prompts(
      tasks.ArithmeticSource(10, 0, max_operand=9, ops='+'), encode, **kw
    )
  assert 'empty answer' not in caplog.text
