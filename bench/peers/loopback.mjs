// Preloaded into the Portkey gateway (node --import): every server it starts listens on 127.0.0.1
// only. Its start-up passes a port and no host, which would mean every interface.
import net from "node:net";

const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
  if (typeof args[0] === "number" || typeof args[0] === "string") {
    const callback = args.find((a) => typeof a === "function");
    return callback ? listen.call(this, Number(args[0]), "127.0.0.1", callback)
                    : listen.call(this, Number(args[0]), "127.0.0.1");
  }
  if (args[0] && typeof args[0] === "object" && !("fd" in args[0]) && !("path" in args[0])) {
    return listen.call(this, { ...args[0], host: "127.0.0.1" }, ...args.slice(1));
  }
  return listen.apply(this, args);
};
