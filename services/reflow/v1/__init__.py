"""Generated gRPC code; see reflow.protogen."""
