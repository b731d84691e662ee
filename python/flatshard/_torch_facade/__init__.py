"""torch FSDP1's surface over flatshard: what torch's class, attributes and internals answer.

- members.py: every member of torch's class and what flatshard does with it (provided, refused,
  not needed), one declarative table checked against torch's class ([Note: The member table]);
- attributes.py: torch's public attributes and handle, read from a unit's state;
- internals.py: torch's private state frameworks reach for, and the errors for the rest;
- opt_in.py: the opt-in that makes torch's class flatshard's ([Note: flatshard as torch's FSDP]).
"""
