"""Environment turns enter the sequence as the chat template's delta for
the new messages only; the history is never decoded and re-encoded."""

import pytest

from jaxcorr.agents.turns import ARITH_TOOL_TEMPLATE, TurnFormat
from jaxcorr.data.chat import ChatTemplate
from jaxcorr.data.tasks import CharTokenizer
from tests.helpers.chat_tokenizer import CHATML, chat_tokenizer

USER = [{'role': 'user', 'content': 'What is 12*34?'}]
TOOL = [{'role': 'tool', 'content': '408'}]


def test_chatml_delta_drops_the_sampled_end_token():
  tok, _ = chat_tokenizer()
  fmt = TurnFormat(ChatTemplate(CHATML), tok)
  assert fmt.tail == '<|im_end|>\n'
  end = tok.eos_id
  prompt = fmt.prompt_ids(USER)
  assert prompt == tok.encode(ChatTemplate(CHATML).render(USER), bos=True)
  agent1 = [*tok.encode('call 12*34', bos=False), end]
  env = fmt.env_ids(TOOL, last_agent_token=end)
  assert env == tok.encode(
    '\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n', bos=False
  )
  agent2 = [*tok.encode('408', bos=False), end]
  # The sequence equals the template's rendering of the conversation.
  conversation = [
    *USER,
    {'role': 'assistant', 'content': 'call 12*34'},
    *TOOL,
    {'role': 'assistant', 'content': '408'},
  ]
  whole = ChatTemplate(CHATML).render(conversation, add_generation_prompt=False)
  assert prompt + agent1 + env + agent2 == tok.encode(whole)[:-1]  # no '\n'
  # A turn cut by its length (no end token) gets the template's full tail.
  cut = fmt.env_ids(TOOL, last_agent_token=None)
  assert cut == [end, *env]


def test_sampled_ids_that_re_encode_differently_stay_as_sampled():
  """The agent spelled '<|im_end|>' one character at a time: re-encoding
  the decoded text would merge them into the special id and change the
  sequence the trainer scores; the trajectory appends only the delta."""
  tok, _ = chat_tokenizer()
  fmt = TurnFormat(ChatTemplate(CHATML), tok)
  spelled = [tok.encode(c, bos=False)[0] for c in '<|im_end|>']
  agent = [*spelled, tok.eos_id]
  text = tok._tok.decode(agent, skip_special_tokens=False)
  assert tok.encode(text, bos=False) != agent  # the drift avoided
  seq = fmt.prompt_ids(USER) + agent + fmt.env_ids(TOOL, tok.eos_id)
  assert seq[len(fmt.prompt_ids(USER)) :][: len(agent)] == agent


def test_arith_template_in_the_character_vocabulary():
  tok = CharTokenizer()
  fmt = TurnFormat(ChatTemplate(ARITH_TOOL_TEMPLATE), tok)
  prompt = fmt.prompt_ids([{'role': 'user', 'content': '17*25='}])
  assert tok.decode(prompt) == 'Q: 17*25=?\nA: '
  env = fmt.env_ids([{'role': 'tool', 'content': '425'}], tok.eos_id)
  assert tok.decode(env) == '\n= 425\nA: '


def test_a_template_that_rewrites_past_turns_is_refused():
  rewrites = (
    '{% for m in messages %}{{ m.role }}'
    "{% if loop.last %}{{ ' (last)' }}{% endif %}: {{ m.content }}\n"
    '{% endfor %}'
  )
  tok, _ = chat_tokenizer()
  fmt = TurnFormat(ChatTemplate(rewrites), tok)
  with pytest.raises(ValueError, match='prefix-stable'):
    fmt.env_ids(TOOL, None)
