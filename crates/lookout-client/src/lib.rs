//! Client for lookout's node-local gRPC API.
