"""The PD decode pool's pick: least load among the workers with device room for the request.

A handoff needs device pages for its whole prompt when the decode worker admits it; a worker
whose published free pages (free, or held only by its evictable cache) are fewer would keep it
waiting (or preempt), so such workers rank after every worker with room, by load among
themselves. A worker that publishes nothing (static list, Redis down) counts as having room.
"""

from __future__ import annotations

from gcache.router.config import RouterPolicy
from gcache.router.policies import Mode, Policy, load_of

NO_ROOM_PENALTY = 1e9  # after every worker with room


class DecodeLoad(Policy):
    name = RouterPolicy.LEAST_LOAD

    def evaluate(self, p, cands):
        out = {}
        for c in cands:
            load = load_of(c, self.cfg)
            ps = c.reg.page_size if c.reg is not None else p.default_page_size
            free = c.reg.load.free_pages if c.reg is not None else -1
            room = free < 0 or free >= -(-(p.num_tokens + 1) // ps)
            out[c.url] = {
                "load": load,
                "free_pages": free,
                "room": room,
                "score": -load - (0 if room else NO_ROOM_PENALTY),
            }
        return Mode.LOAD, out
