// A gRPC-Web client from npm, run by Node: Connect's gRPC-Web transport (the one browsers
// use, over fetch) with the service built at run time from the server's descriptor set,
// so no generated JS is checked in.
//
//   node client.mjs BASE_URL DESCRIPTOR_SET_FILE METHOD REQUEST_JSON
//
// Prints one JSON line per response message, then {"status": "ok"} or
// {"status": "error", "code": <Connect code name>, "message": ...}.
import { readFileSync } from "node:fs";
import { create, createFileRegistry, fromBinary, fromJson, toJson } from "@bufbuild/protobuf";
import { FileDescriptorSetSchema } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createGrpcWebTransport } from "@connectrpc/connect-web";

const [baseUrl, descriptorFile, methodName, requestJson] = process.argv.slice(2);
const registry = createFileRegistry(fromBinary(FileDescriptorSetSchema, readFileSync(descriptorFile)));
const service = registry.getService("quicserve.v1.Inference");
const method = service.methods.find((m) => m.name === methodName);
const client = createClient(service, createGrpcWebTransport({ baseUrl, useBinaryFormat: true }));
const request = fromJson(method.input, JSON.parse(requestJson), { registry });
const print = (msg) => console.log(JSON.stringify(toJson(method.output, msg, { registry })));

try {
  if (method.methodKind === "server_streaming") {
    for await (const reply of client[method.localName](request)) print(reply);
  } else {
    print(await client[method.localName](request));
  }
  console.log(JSON.stringify({ status: "ok" }));
} catch (e) {
  const err = ConnectError.from(e);
  console.log(JSON.stringify({ status: "error", code: Code[err.code], message: err.rawMessage }));
}
