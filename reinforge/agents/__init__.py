"""Agents that drive episodes through the policy's OpenAI-compatible endpoint (`rollout.driver=agent`,
`agent.python.NAME=module:function`). Each is an example to copy as much as a ready part."""
