"""What the tests and the benchmark share: free ports, loopback servers, the scripted and fault upstreams, the
OpenAI chunk encoding, tape builders, llmtap and its peers as child processes."""
