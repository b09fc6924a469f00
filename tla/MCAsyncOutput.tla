--------------------------- MODULE MCAsyncOutput ---------------------------
(* Model values for AsyncOutput: the batches of each model (a .cfg file    *)
(* picks one with  Batch <- ...), and their consumer.                      *)
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
=============================================================================
