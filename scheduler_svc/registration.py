"""Register / Deregister of workers, served by every front-end next to the public API and answered by the
supervisor, which drives the workers."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from common.security import RegistrationPolicy
from protos import membership_pb2 as mpb
from protos import membership_pb2_grpc
from scheduler_svc.responses import abort

if TYPE_CHECKING:
    from scheduler_svc.frontend import Frontend

log = logging.getLogger("splitserve.scheduler")


def _valid_address(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


class MembershipService(membership_pb2_grpc.MembershipServicer):
    """Register / Deregister, served next to the public API and answered by the supervisor, which drives the
    workers. Who may call them: the policy (common.security): mutual TLS, a shared secret, or nobody."""

    def __init__(self, frontend: Frontend, policy: RegistrationPolicy):
        self.frontend, self.policy = frontend, policy

    async def _authorize(self, context, request) -> None:
        reason = self.policy.refusal(context.invocation_metadata())
        if reason is not None:
            log.warning("membership call refused from %s for worker %r: %s", context.peer(), request.address,
                        reason, extra={"worker": request.address})
            await abort(context, grpc.StatusCode.UNAUTHENTICATED, reason)

    async def Register(self, request: mpb.RegisterRequest, context) -> mpb.RegisterResponse:
        await self._authorize(context, request)
        if not self.frontend.accepting:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
        if not _valid_address(request.address):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"address must be HOST:PORT, got {request.address!r}")
        reply = await self.frontend.ask_supervisor(["register", request.address, request.worker_id, request.epoch])
        if reply.get("code"):
            await abort(context, grpc.StatusCode[reply["code"]], reply["message"])
        return mpb.RegisterResponse(scheduler_id=reply["scheduler_id"], already_member=reply["already_member"])

    async def Deregister(self, request: mpb.DeregisterRequest, context) -> mpb.DeregisterResponse:
        await self._authorize(context, request)
        reply = await asyncio.shield(self.frontend.ask_supervisor(
            ["deregister", request.address, request.worker_id, max(0.0, request.grace_s)]))
        return mpb.DeregisterResponse(moved=reply["moved"], was_member=reply["was_member"])
