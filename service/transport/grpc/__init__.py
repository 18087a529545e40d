"""The gRPC server: servicer, request decoding, errors, auth, busy polling, listeners."""
