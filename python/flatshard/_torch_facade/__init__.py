"""torch's FSDP surface over flatshard: what torch's FSDP1 class, attributes and internals answer; what torch's code
reads of a fully_shard module.

- members.py: every member of torch's class and what flatshard does with it (provided, refused,
  not needed), one declarative table checked against torch's class ([Note: The member table]);
- attributes.py: torch's public attributes and handle, read from a unit's state;
- internals.py: torch's private state frameworks reach for, and the errors for the rest;
- opt_in.py: the opt-in that makes torch's class flatshard's ([Note: flatshard as torch's FSDP]);
- fsdp2_state.py: torch FSDP2's state object as torch's pipelining reads it from a fully_shard module ([Note:
  Pipelining reduces the gradients itself]);
- composable_registry.py: fully_shard modules in torch's registry of composable APIs, which its replicate reads ([Note:
  Composing with torch's replicate]).
"""
