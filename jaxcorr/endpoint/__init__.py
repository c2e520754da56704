"""An OpenAI-compatible endpoint over the rollout engine: any agent that
speaks the OpenAI API trains as a multi-turn environment (docs/agents.md,
"Agents over the OpenAI API")."""

from jaxcorr.endpoint.environment import (
  AgentCall,
  AgentEnvironment,
  EndpointSettings,
  register_agent,
)
from jaxcorr.endpoint.server import EndpointServer, shared_server

__all__ = [
  'AgentCall',
  'AgentEnvironment',
  'EndpointServer',
  'EndpointSettings',
  'register_agent',
  'shared_server',
]
