"""Private swarms: who may call a peer, and how a caller proves it.

keys.py: `swarm keys init` (a swarm's CA) and `swarm keys issue` (a member's key and certificate); members.py:
MemberVerifier (is this certificate one the swarm's CA issued?); credentials.py: SwarmCredentials (a member's
credentials or the explicit open swarm; builds every gRPC server and channel); call_auth.py: the per-call
signature and its check; interceptors.py: the gRPC interceptors that apply it, and `authenticated_member`.
"""

from __future__ import annotations

from swarm.security.credentials import SwarmCredentials
from swarm.security.interceptors import authenticated_member
from swarm.security.keys import TLS_NAME, init_swarm, issue_member
from swarm.security.members import Member, MemberVerifier, NotAMember

__all__ = [
    "TLS_NAME",
    "Member",
    "MemberVerifier",
    "NotAMember",
    "SwarmCredentials",
    "authenticated_member",
    "init_swarm",
    "issue_member",
]
