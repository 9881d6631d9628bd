// The copy buttons of the pages that show new tokens once (a file, as the admin's
// Content-Security-Policy runs no inline script): each copies the field it names.
(function () {
  for (const button of document.querySelectorAll("button.copy-token")) {
    const field = document.getElementById(button.dataset.copies);
    const result = document.getElementById(button.dataset.result);
    button.addEventListener("click", async function () {
      try {
        await navigator.clipboard.writeText(field.value);
      } catch (error) {
        // Without the Clipboard API (a page served over plain http to another host), copy the selection.
        field.select();
        if (!document.execCommand("copy")) { result.textContent = "Select the token and copy it."; return; }
      }
      result.textContent = "Copied.";
    });
  }
})();
