"""Writes tests/golden/distill/{golden.npz,index.json} (run once; not a test).

Re-enacts, line for line, TRL's GKDTrainer.generalized_jsd_loss (labels path,
reduction='batchmean') and verl's distillation losses
(verl/trainer/distillation/losses.py @3baac34: kullback_leibler_divergence on a
top-k support + clamp_min(0), and the kl_penalty estimator loss), on CPU,
float32, torch 1 thread: the GPU frameworks do not run here.

  .venv/bin/python tests/golden/distill/generate.py tests/golden/distill
"""

import json
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
OUT = sys.argv[1]
rng = np.random.default_rng(20261128)
B, T, V, K = 3, 6, 11, 3
lengths = np.array([6, 4, 1])
mask = np.arange(T)[None] < lengths[:, None]
junk = 37.0
s_logits = rng.normal(0, 2.0, (B, T, V)).astype(np.float32)
t_logits = rng.normal(0, 2.0, (B, T, V)).astype(np.float32)
s_logits[~mask] = junk
t_logits[~mask] = -junk


# --- TRL GKDTrainer.generalized_jsd_loss (reduction='batchmean', labels given)
def trl_gjsd(student_logits, teacher_logits, labels, beta, temperature):
  student_logits = student_logits / temperature
  teacher_logits = teacher_logits / temperature
  student_log_probs = F.log_softmax(student_logits, dim=-1)
  teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
  if beta == 0:
    jsd = F.kl_div(
      student_log_probs, teacher_log_probs, reduction='none', log_target=True
    )
  elif beta == 1:
    jsd = F.kl_div(
      teacher_log_probs, student_log_probs, reduction='none', log_target=True
    )
  else:
    beta = torch.tensor(beta, dtype=student_log_probs.dtype)
    mixture_log_probs = torch.logsumexp(
      torch.stack(
        [
          student_log_probs + torch.log1p(-beta),
          teacher_log_probs + torch.log(beta),
        ]
      ),
      dim=0,
    )
    kl_teacher = F.kl_div(
      mixture_log_probs, teacher_log_probs, reduction='none', log_target=True
    )
    kl_student = F.kl_div(
      mixture_log_probs, student_log_probs, reduction='none', log_target=True
    )
    jsd = beta * kl_teacher + (1 - beta) * kl_student
  mask_ = labels != -100
  jsd = jsd[mask_]
  return jsd.sum() / mask_.sum()


# --- verl distillation losses
def clamp_log_probs(log_p, log_q, eps=1e-8):
  m = math.log(eps)
  return torch.clamp(log_p, min=m), torch.clamp(log_q, min=m)


def kl_divergence(log_q, log_p):
  return F.kl_div(
    input=log_q, target=log_p, reduction='none', log_target=True
  ).sum(dim=-1)


def verl_topk(student_topk, teacher_topk, direction):
  log_p, log_q = clamp_log_probs(teacher_topk, student_topk)
  if direction == 'forward':
    return kl_divergence(log_q=log_q, log_p=log_p)
  return kl_divergence(log_q=log_p, log_p=log_q)


def token_mean(loss_mat, m):
  return (loss_mat * m).sum() / m.sum()


def verl_kl_penalty(logprob, ref_logprob, mode):
  if mode == 'k1':
    return logprob - ref_logprob
  kl = ref_logprob - logprob
  kl = torch.clamp(kl, min=-20, max=20)
  ratio = torch.exp(kl)
  kld = ratio - kl - 1
  return torch.clamp(kld, min=-10, max=10)


arrays, cases = {}, []
arrays['inputs/student_logits'] = s_logits
arrays['inputs/teacher_logits'] = t_logits
arrays['inputs/mask'] = mask
labels = np.where(mask, 1, -100)

for beta in (0.0, 0.1, 0.5, 0.9, 1.0):
  for tau in (1.0, 0.7) if beta == 0.5 else (1.0,):
    cid = f'trl_gjsd/beta{beta}_tau{tau}'
    s = torch.tensor(s_logits, requires_grad=True)
    loss = trl_gjsd(s, torch.tensor(t_logits), torch.tensor(labels), beta, tau)
    loss.backward()
    arrays[cid + '/loss'] = np.float32(loss.item())
    arrays[cid + '/grad_student_logits'] = s.grad.numpy()
    cases.append(
      {
        'id': cid,
        'function': 'trl.GKDTrainer.generalized_jsd_loss',
        'kwargs': {
          'beta': beta,
          'temperature': tau,
          'reduction': 'batchmean',
          'labels': '-100 outside mask',
        },
      }
    )

# top-k: student log-probs (full softmax) gathered on teacher-topk ++ student-topk indices
s_lp_full = F.log_softmax(torch.tensor(s_logits), -1)
t_lp_full = F.log_softmax(torch.tensor(t_logits), -1)
idx = torch.cat(
  [t_lp_full.topk(K, -1).indices, s_lp_full.topk(K, -1).indices], -1
)
arrays['inputs/topk_indices'] = idx.numpy().astype(np.int32)
m_t = torch.tensor(mask)
for direction in ('forward', 'reverse'):
  for clamp in (None, 0.5):
    cid = f'verl_topk/{direction}_kl_topk_clamp{clamp}'
    s = torch.tensor(s_logits, requires_grad=True)
    s_top = F.log_softmax(s, -1).gather(-1, idx)
    t_top = t_lp_full.gather(-1, idx)
    losses = verl_topk(s_top, t_top, direction)
    if clamp is not None:
      losses = losses.clamp_max(clamp)
    losses = losses.clamp_min(0.0)
    loss = token_mean(losses, m_t)
    loss.backward()
    arrays[cid + '/loss'] = np.float32(loss.item())
    arrays[cid + '/grad_student_logits'] = s.grad.numpy()
    arrays[cid + '/student_mass'] = np.float32(
      s_top.exp().sum(-1)[m_t].mean().item()
    )
    arrays[cid + '/teacher_mass'] = np.float32(
      t_top.exp().sum(-1)[m_t].mean().item()
    )
    cases.append(
      {
        'id': cid,
        'function': 'verl.trainer.distillation.losses.compute_distillation_loss_topk',
        'kwargs': {
          'loss_mode': f'{direction}_kl_topk',
          'topk': K,
          'loss_clamp': clamp,
          'loss_agg_mode': 'token-mean',
        },
      }
    )

# estimator losses on the sampled tokens
ids = rng.integers(0, V, (B, T))
arrays['inputs/sampled_ids'] = ids.astype(np.int32)
for mode in ('k1', 'low_var_kl'):
  cid = f'verl_estimator/{mode}'
  s = torch.tensor(s_logits, requires_grad=True)
  s_lp = F.log_softmax(s, -1).gather(-1, torch.tensor(ids)[..., None])[..., 0]
  t_lp = t_lp_full.gather(-1, torch.tensor(ids)[..., None])[..., 0]
  losses = verl_kl_penalty(s_lp, t_lp, mode)
  loss = token_mean(torch.where(m_t, losses, 0.0), m_t)
  loss.backward()
  arrays[cid + '/loss'] = np.float32(loss.item())
  arrays[cid + '/grad_student_logits'] = s.grad.numpy()
  cases.append(
    {
      'id': cid,
      'function': 'verl.trainer.distillation.losses.compute_distillation_loss_reverse_kl_estimator',
      'kwargs': {
        'loss_mode': mode,
        'loss_clamp': None,
        'loss_agg_mode': 'token-mean',
      },
    }
  )

np.savez_compressed(OUT + '/golden.npz', **arrays)
index = {
  'format': 'jaxcorr-golden-distill/1',
  'meta': {
    'torch': torch.__version__,
    'threads': 1,
    'dtype': 'float32',
    'sources': {
      'trl': 'GKDTrainer.generalized_jsd_loss (labels path, log1p mixture; trl main 2025-26)',
      'verl': 'verl/trainer/distillation/losses.py @ 3baac34541d6',
    },
    'B': B,
    'T': T,
    'V': V,
    'K': K,
    'lengths': lengths.tolist(),
    'padding': 'student logits +37, teacher logits -37 outside mask',
    'note': 'reference functions re-enacted line for line in torch on CPU (no GPU frameworks installed); gradients are d loss / d student_logits',
  },
  'cases': cases,
}
with open(OUT + '/index.json', 'w') as f:
  json.dump(index, f, indent=1)
print(len(cases), 'cases')
