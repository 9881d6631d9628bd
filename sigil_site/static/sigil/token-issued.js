// The copy button of the page that shows a new token once (a file, as the admin's
// Content-Security-Policy runs no inline script).
(function () {
  const field = document.getElementById("token-secret");
  const result = document.getElementById("copy-result");
  document.getElementById("copy-token").addEventListener("click", async function () {
    try {
      await navigator.clipboard.writeText(field.value);
    } catch (error) {
      // Without the Clipboard API (a page served over plain http to another host), copy the selection.
      field.select();
      if (!document.execCommand("copy")) { result.textContent = "Select the token and copy it."; return; }
    }
    result.textContent = "Copied.";
  });
})();
