from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("address", "worker_id", "epoch")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    address: str
    worker_id: str
    epoch: int
    def __init__(self, address: _Optional[str] = ..., worker_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("scheduler_id", "already_member")
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    ALREADY_MEMBER_FIELD_NUMBER: _ClassVar[int]
    scheduler_id: str
    already_member: bool
    def __init__(self, scheduler_id: _Optional[str] = ..., already_member: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("address", "worker_id", "grace_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    worker_id: str
    grace_s: float
    def __init__(self, address: _Optional[str] = ..., worker_id: _Optional[str] = ..., grace_s: _Optional[float] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ("moved", "was_member")
    MOVED_FIELD_NUMBER: _ClassVar[int]
    WAS_MEMBER_FIELD_NUMBER: _ClassVar[int]
    moved: int
    was_member: bool
    def __init__(self, moved: _Optional[int] = ..., was_member: _Optional[bool] = ...) -> None: ...
