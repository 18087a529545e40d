"""The calls on the wire's messages that need more than the engine: device plane, device
puts, and the client tensors they name. gRPC and the session socket share them.
"""
