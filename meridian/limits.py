"""Size limits that every hop agrees on, so that what a gateway accepts a worker can take.

A request's protobuf form is never much larger than its JSON body (the same strings, shorter
numbers), so one limit serves both: the gateway answers 413 for a larger HTTP body and refuses a
larger gRPC message, and every gRPC server in between receives messages up to MAX_MESSAGE_BYTES
(the limit plus room for protobuf framing).
"""

MAX_REQUEST_BYTES = 8 * 2**20
MAX_MESSAGE_BYTES = MAX_REQUEST_BYTES + 2**16
