--------------------------- MODULE MCAsyncOutput ---------------------------
(* Model values for AsyncOutput: the batches of each model (a .cfg file    *)
(* picks one with  Batch <- ...), their consumer, and their chunks.        *)
EXTENDS AsyncOutput

\* One batched RPC of two requests.
BatchOfTwo == << <<"a", "b">> >>

\* Two RPCs in flight: a batch of two, then a single request.
TwoRpcs == << <<"a", "b">>, <<"c">> >>

\* Two single-request RPCs.
TwoSingles == << <<"a">>, <<"b">> >>

\* One single-request RPC.
OneRequest == << <<"a">> >>

\* The model's engine is one consumer: every call is its.
OneConsumer == [k \in DOMAIN Batch |-> "c"]

\* No call streams chunks (Chunks <- NoChunks).
NoChunks == [k \in DOMAIN Batch |-> <<>>]

\* The one RPC streams two chunks (a preview, then another) before its output.
TwoChunks == << <<"p", "q">> >>

\* The one RPC streams one chunk.
OneChunk == << <<"p">> >>

\* Step mode with final-step async: an intermediate step (no output), then
\* the final step (Steps = {1, 2}).
StepThenFinal == << <<>>, <<"a">> >>
=============================================================================
