"""The session socket: Session calls on a plain Unix socket beside the gRPC one."""
